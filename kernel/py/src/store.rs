//! `BlockStore`: a namespace's per-block state, compiled. Its semantics are
//! `kvconductor/index/block_store.py`'s `PyBlockStore`, call for call
//! (tests/test_block_store.py drives both and compares them).
//!
//! The layout is for memory (at most 100 bytes per (block, owner)):
//! - the catalog maps a sequence hash to its identity, holder count and
//!   retired-queue stamp (24 bytes a bucket); owner tiers and pool stores
//!   hold bare sequence hashes and read identities from here, which never
//!   change while a block is held;
//! - owner masks are split into 64-slot words, one map per word and tier,
//!   so an identity costs 16 bytes per word in which it has owners;
//! - retired entries (held by nobody, kept for late halves) queue in a FIFO
//!   with lazy deletion: a record is live while its catalog entry is unheld
//!   and still carries the record's stamp.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::hash_map::Entry;
use hashbrown::{HashMap, HashSet};
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyKeyError, PyOverflowError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::shape::AnswerShape;
use kvconductor_core::maps::{CountMap, SeqSet};
use kvconductor_core::maps::{ShardedMap, Vacant};

const DEVICE: usize = 0;
const HOST: usize = 1;
const DISK: usize = 2;
const TIERS: usize = 3;
/// Owner slots are bits of the masks; a bound keeps a wrong slot from
/// allocating words for millions of them.
const MAX_SLOTS: usize = 1 << 20;

/// One process-wide sequence, so that a namespace dropped and created again
/// never repeats a version a snapshot already published.
static CHANGES: AtomicU64 = AtomicU64::new(0);

fn next_version() -> u64 {
    CHANGES.fetch_add(1, Ordering::Relaxed) + 1
}

// ------------------------------------------------------------------ catalog

#[derive(Clone, Copy)]
struct Block {
    ident: u64,
    /// Holders; 0: retired (queued). Never `u32::MAX` (an empty slot's).
    refs: u32,
    /// The stamp of the block's live retired record, when retired. Stamps
    /// wrap at 2^32; a stale record could only be mistaken for a live one
    /// after 2^32 newer records, more than the queue can hold (compaction
    /// keeps it below twice its live records).
    stamp: u32,
}

impl Vacant for Block {
    const VACANT: Self = Block { ident: 0, refs: u32::MAX, stamp: 0 };
    fn is_vacant(&self) -> bool {
        self.refs == u32::MAX
    }
}

struct Record {
    seq: u64,
    ts: f64,
    stamp: u32,
}

/// Sequence hash -> content, with the retired entries' FIFO: `PendingQueue`
/// semantics (append unless present, evict the oldest beyond the count
/// bound, expire from the head by age).
struct Catalog {
    map: ShardedMap<Block>,
    queue: VecDeque<Record>,
    live: usize,
    next_stamp: u32,
    max_entries: usize,
    max_age_s: f64,
    version: u64,
    now: f64,
    /// While a cut is open (`begin_cut`): what the catalog forgot since,
    /// with the identity it had, for `cut_identities`.
    forgotten: Option<HashMap<u64, u64>>,
    cuts: u32,
}

impl Catalog {
    fn new(max_entries: usize, max_age_s: f64) -> Self {
        Catalog {
            map: ShardedMap::default(),
            queue: VecDeque::new(),
            live: 0,
            next_stamp: 0,
            max_entries,
            max_age_s,
            version: 0,
            now: 0.0,
            forgotten: None,
            cuts: 0,
        }
    }

    /// Takes `seq` out of the map, keeping its identity while a cut is open.
    fn forget(&mut self, seq: u64) {
        if let Some(b) = self.map.remove(&seq) {
            if let Some(kept) = &mut self.forgotten {
                kept.entry(seq).or_insert(b.ident);
            }
        }
    }

    /// The catalog entry of a live record (unheld, still carrying its stamp).
    fn live<'m>(map: &'m ShardedMap<Block>, r: &Record) -> Option<&'m Block> {
        map.get(&r.seq).filter(|b| b.refs == 0 && b.stamp == r.stamp)
    }

    fn ident(&self, seq: u64) -> Option<u64> {
        self.map.get(&seq).map(|b| b.ident)
    }

    /// The identity of a block some tier holds (always in the catalog).
    fn held_ident(&self, seq: u64) -> u64 {
        self.ident(seq).unwrap_or_default()
    }

    /// A reference on `seq`'s content; its canonical identity.
    fn acquire(&mut self, seq: u64, ident: u64) -> u64 {
        let (b, new) = self.map.get_or_insert_with(seq, || Block { ident, refs: 0, stamp: 0 });
        let revived = !new && b.refs == 0;
        b.refs += 1;
        let canon = b.ident;
        if revived {
            self.unqueued();
        }
        canon
    }

    /// Drops a reference; returns the identity (the entry may be gone when
    /// the retired bound evicted it at once).
    fn release(&mut self, seq: u64) -> PyResult<u64> {
        let stamp = self.next_stamp;
        let b = match self.map.get_mut(&seq) {
            Some(b) if b.refs > 0 => b,
            _ => return Err(PyKeyError::new_err(seq)),
        };
        b.refs -= 1;
        let ident = b.ident;
        if b.refs == 0 {
            b.stamp = stamp;
            let now = self.now;
            self.enqueue(seq, now);
        }
        Ok(ident)
    }

    /// Known content nobody holds, retired at `ts`, unless the catalog has it.
    fn retire_new(&mut self, seq: u64, ident: u64, ts: f64) {
        let stamp = self.next_stamp;
        if self.map.get_or_insert_with(seq, || Block { ident, refs: 0, stamp }).1 {
            self.enqueue(seq, ts);
        }
    }

    /// Queues the block just retired with stamp `next_stamp`.
    fn enqueue(&mut self, seq: u64, ts: f64) {
        let stamp = self.next_stamp;
        self.next_stamp = stamp.wrapping_add(1);
        self.queue.push_back(Record { seq, ts, stamp });
        self.live += 1;
        self.version = next_version();
        while self.live > self.max_entries && self.drop_head() {}
    }

    /// A retired block was taken back: its record goes stale.
    fn unqueued(&mut self) {
        self.live -= 1;
        self.version = next_version();
        if self.queue.len() > 2 * self.live + 64 {
            let map = &self.map;
            self.queue.retain(|r| Catalog::live(map, r).is_some());
        }
    }

    /// The oldest live record's retirement time, past stale ones.
    fn head_ts(&mut self) -> Option<f64> {
        while let Some(r) = self.queue.front() {
            if Catalog::live(&self.map, r).is_some() {
                return Some(r.ts);
            }
            self.queue.pop_front();
        }
        None
    }

    /// Forgets the oldest live retired entry; false when there is none.
    fn drop_head(&mut self) -> bool {
        if self.head_ts().is_none() {
            return false;
        }
        if let Some(r) = self.queue.pop_front() {
            self.forget(r.seq);
            self.live -= 1;
            self.version = next_version();
        }
        true
    }

    fn expire(&mut self, now: f64) {
        let cutoff = now - self.max_age_s;
        while let Some(ts) = self.head_ts() {
            // Not `ts < cutoff`: a NaN clock expires, as in `PendingQueue`.
            if ts >= cutoff {
                return;
            }
            self.drop_head();
        }
    }

    fn retired(&self) -> impl Iterator<Item = (u64, u64, f64)> + '_ {
        self.queue.iter().filter_map(|r| Catalog::live(&self.map, r).map(|b| (r.seq, b.ident, r.ts)))
    }

    fn clear_retired(&mut self) {
        for r in std::mem::take(&mut self.queue) {
            if Catalog::live(&self.map, &r).is_some() {
                self.forget(r.seq);
            }
        }
        if self.live > 0 {
            self.live = 0;
            self.version = next_version();
        }
    }
}

// ------------------------------------------------------------------ holders

/// An owner tier or a pool store: the sequence hashes it holds and the
/// query map it keeps counted.
trait Holder {
    fn set(&mut self) -> &mut SeqSet;
    fn count(&mut self, seq: u64, ident: u64) -> PyResult<()>;
    fn uncount(&mut self, ident: u64);
    /// Room for `n` more blocks.
    fn reserve(&mut self, n: usize);
}

struct OwnerTier<'a> {
    set: &'a mut SeqSet,
    /// The tier's masks for the owner's 64-slot word.
    masks: &'a mut CountMap,
    /// (tier, identity) -> holders beyond the first.
    dups: &'a mut HashMap<(u8, u64), u32>,
    tier: u8,
    bit: u64,
}

impl Holder for OwnerTier<'_> {
    fn set(&mut self) -> &mut SeqSet {
        self.set
    }

    fn reserve(&mut self, n: usize) {
        self.set.reserve(n);
        self.masks.reserve(n);
    }

    fn count(&mut self, _: u64, ident: u64) -> PyResult<()> {
        if self.masks.or(ident, self.bit) & self.bit != 0 {
            *self.dups.entry((self.tier, ident)).or_insert(0) += 1;
        }
        Ok(())
    }

    fn uncount(&mut self, ident: u64) {
        // Most owners hold no copies: no probe of an empty map.
        if !self.dups.is_empty() {
            if let Entry::Occupied(mut o) = self.dups.entry((self.tier, ident)) {
                if *o.get() == 1 {
                    o.remove();
                } else {
                    *o.get_mut() -= 1;
                }
                return;
            }
        }
        self.masks.clear_bits(ident, self.bit);
    }
}

struct PoolBlocks<'a, 'py> {
    set: &'a mut SeqSet,
    counts: &'a mut CountMap,
    /// Where newly held hashes are reported.
    placed_out: Option<&'a Bound<'py, PyList>>,
}

impl Holder for PoolBlocks<'_, '_> {
    fn set(&mut self) -> &mut SeqSet {
        self.set
    }

    fn reserve(&mut self, n: usize) {
        self.set.reserve(n);
        self.counts.reserve(n);
    }

    fn count(&mut self, seq: u64, ident: u64) -> PyResult<()> {
        self.counts.increment(ident);
        if let Some(out) = self.placed_out {
            out.append(seq)?;
        }
        Ok(())
    }

    fn uncount(&mut self, ident: u64) {
        self.counts.decrement(ident);
    }
}

/// (placed, dropped at capacity, hash conflicts, hashes left to wait)
type Placed = (usize, usize, usize, Vec<u64>);

/// `PyBlockStore._place_*`: with `idents` every block's content is given;
/// without, unknown blocks are left to wait and known ones placed.
fn place(cat: &mut Catalog, h: &mut impl Holder, seqs: &[u64], idents: Option<&[u64]>, room: i64) -> PyResult<Placed> {
    let (mut placed, mut dropped, mut conflicts) = (0usize, 0usize, 0usize);
    let mut waits = Vec::new();
    for (k, &seq) in seqs.iter().enumerate() {
        if idents.is_none() && !cat.map.contains_key(&seq) {
            waits.push(seq);
            continue;
        }
        if !h.set().insert(seq) {
            continue;
        }
        if placed as i64 >= room {
            h.set().remove(&seq);
            // What is left is dropped, or waits when its content is unknown.
            for &rest in &seqs[k..] {
                if idents.is_some() || cat.map.contains_key(&rest) {
                    dropped += 1;
                } else {
                    waits.push(rest);
                }
            }
            break;
        }
        let ident = match idents {
            Some(given) => {
                let Some(&given) = given.get(k) else {
                    h.set().remove(&seq);
                    return Err(PyIndexError::new_err("fewer identities than hashes"));
                };
                let ident = cat.acquire(seq, given);
                if ident != given {
                    conflicts += 1;
                }
                ident
            }
            // Known: the catalog's identity.
            None => cat.acquire(seq, 0),
        };
        h.count(seq, ident)?;
        placed += 1;
    }
    Ok((placed, dropped, conflicts, waits))
}

fn unplace(cat: &mut Catalog, h: &mut impl Holder, seq: u64) -> PyResult<bool> {
    if !h.set().remove(&seq) {
        return Ok(false);
    }
    let ident = cat.release(seq)?;
    h.uncount(ident);
    Ok(true)
}

/// Takes every block out, in ascending hash order (the retired queue's
/// order must not depend on hash-set iteration).
fn clear(cat: &mut Catalog, h: &mut impl Holder) -> PyResult<usize> {
    let mut seqs: Vec<u64> = h.set().iter().copied().collect();
    seqs.sort_unstable();
    for &seq in &seqs {
        unplace(cat, h, seq)?;
    }
    Ok(seqs.len())
}

/// A bulk load: placing block by block into an empty holder, unbounded.
fn load(cat: &mut Catalog, h: &mut impl Holder, empty: bool, seqs: &[u8], idents: &[u8], what: &str) -> PyResult<()> {
    let (s, i) = (unpack(seqs)?, unpack(idents)?);
    if s.len() != i.len() {
        return Err(PyValueError::new_err(format!("a {what}'s hashes and identities differ in count")));
    }
    if !empty {
        return Err(PyAssertionError::new_err(format!("load is for an empty {what}")));
    }
    // Grown once, not by doubling through the load.
    cat.map.reserve(s.len());
    h.reserve(s.len());
    place(cat, h, &s, Some(&i), i64::MAX)?;
    Ok(())
}

// ---------------------------------------------------------------- python io

/// A sequence of ints as u64 (lists without the iterator protocol).
fn u64s(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(list) = obj.cast::<PyList>() {
        if let Some(out) = list_u64s(list) {
            return Ok(out);
        }
        // Some item is not an int in range: convert each, to raise its error.
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(item.extract()?);
        }
        return Ok(out);
    }
    obj.try_iter()?.map(|item| item?.extract()).collect()
}

/// A list of ints in [0, 2**64) read in place, without a conversion object
/// per item (pyo3's per-item extraction was ~4% of applying events); None
/// when an item is anything else.
fn list_u64s(list: &Bound<'_, PyList>) -> Option<Vec<u64>> {
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    // SAFETY: a list's items are `ob_item[..len]`; nothing here runs Python
    // code (reading an exact int's value does not), so the list keeps its
    // `n` items throughout.
    let items = unsafe { (*list.as_ptr().cast::<ffi::PyListObject>()).ob_item };
    for i in 0..n {
        let item = unsafe { *items.add(i) };
        if unsafe { ffi::PyLong_CheckExact(item) } == 0 {
            return None;
        }
        let value = unsafe { ffi::PyLong_AsUnsignedLongLong(item) };
        if value == u64::MAX && unsafe { !ffi::PyErr_Occurred().is_null() } {
            // Negative or past 64 bits: the caller's conversion says which.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        out.push(value);
    }
    Some(out)
}

/// A capacity left, as i64 (any Python int: beyond i64 it saturates).
fn room_of(room: &Bound<'_, PyAny>) -> PyResult<i64> {
    match room.extract::<i64>() {
        Err(e) if e.is_instance_of::<PyOverflowError>(room.py()) => Ok(if room.gt(0)? { i64::MAX } else { i64::MIN }),
        other => other,
    }
}

fn unpack(data: &[u8]) -> PyResult<Vec<u64>> {
    if !data.len().is_multiple_of(8) {
        return Err(PyValueError::new_err("bytes length not a multiple of item size"));
    }
    Ok(data.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect())
}

fn pack<'py>(py: Python<'py>, values: impl ExactSizeIterator<Item = u64>) -> Bound<'py, PyBytes> {
    let mut buf = Vec::with_capacity(values.len() * 8);
    for v in values {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    PyBytes::new(py, &buf)
}

/// A Python int as 64-bit words, least significant first.
fn int_words(v: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(w) = v.extract::<u64>() {
        return Ok(vec![w]);
    }
    let bits: usize = v.call_method0("bit_length")?.extract()?;
    let n = bits.div_ceil(64) * 8;
    let raw = v.call_method1("to_bytes", (n, "little"))?;
    unpack(raw.cast::<PyBytes>()?.as_bytes())
}

fn words_int<'py>(py: Python<'py>, words: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    match words.iter().rposition(|w| *w != 0) {
        None => Ok(0u64.into_pyobject(py)?.into_any()),
        Some(0) => Ok(words[0].into_pyobject(py)?.into_any()),
        Some(top) => {
            let raw = pack(py, words[..=top].iter().copied());
            py.get_type::<PyInt>().call_method1("from_bytes", (raw, "little"))
        }
    }
}

fn tier_ix(tier: usize) -> PyResult<usize> {
    if tier < TIERS {
        Ok(tier)
    } else {
        Err(PyIndexError::new_err("tier index out of range"))
    }
}

// -------------------------------------------------------------------- query

/// The prompt's identities, computed a chunk at a time as far as the walk
/// reads them.
struct Prompt<'a, 'py> {
    source: Source<'a, 'py>,
    idents: Vec<u64>,
    len: usize,
}

enum Source<'a, 'py> {
    /// Little-endian u32 tokens, `step` bytes a block, chained from `ident`.
    Tokens {
        data: &'a [u8],
        step: usize,
        ident: u64,
    },
    List(&'a Bound<'py, PyList>),
    /// Everything extracted up front (`idents` is full).
    Given,
}

impl Prompt<'_, '_> {
    /// The identities of blocks `from..`, up to `GATHER` of them (none past
    /// the prompt's end), computed as far as they are read.
    fn chunk(&mut self, from: usize) -> PyResult<&[u64]> {
        let to = (from + GATHER).min(self.len);
        while self.idents.len() < to {
            let i = self.idents.len();
            let id = match &mut self.source {
                Source::Tokens { data, step, ident } => {
                    *ident = xxh3_64_with_seed(&data[i * *step..(i + 1) * *step], *ident);
                    *ident
                }
                Source::List(list) => list.get_item(i)?.extract()?,
                Source::Given => break, // all extracted up front
            };
            self.idents.push(id);
        }
        Ok(&self.idents[from.min(to)..to])
    }
}

/// Blocks whose map probes a walk issues together: each probe of a large
/// index is a likely cache miss, and independent probes overlap them (at
/// four million entries a serial walk spent most of its time waiting on
/// memory). A chunk past a prefix's end costs a few wasted probes.
const GATHER: usize = 16;

/// The blocks each of a word's slots matched, per tier (GPU, CPU, DISK).
type Ends = [[u32; 64]; 3];

fn ended(mut bits: u64, at: usize, into: &mut [u32; 64]) {
    while bits != 0 {
        into[bits.trailing_zeros() as usize] = at as u32;
        bits &= bits - 1;
    }
}

fn probe(m: Option<&CountMap>, id: u64) -> u64 {
    m.map_or(0, |m| m.get(id))
}

fn pooled(m: Option<&CountMap>, id: u64) -> bool {
    m.is_some_and(|m| m.contains(id))
}

fn prefetch(m: Option<&CountMap>, id: u64) {
    if let Some(m) = m {
        m.prefetch(id);
    }
}

/// The JSON answer of a walk's lengths (`AnswerShape::json_of`).
fn answer_json<'py>(
    shape: &Bound<'py, AnswerShape>,
    found: Vec<(usize, u32, u32, u32)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let listed = found.into_iter().map(|(s, g, c, d)| (s, (u64::from(g), u64::from(c), u64::from(d)))).collect();
    shape.borrow_mut().json_of(shape.py(), listed)
}

// -------------------------------------------------------------------- store

struct Owner {
    tiers: [SeqSet; TIERS],
    dups: HashMap<(u8, u64), u32>,
}

struct Pool {
    tier: usize,
    blocks: SeqSet,
}

/// Owner tiers and pools frozen at an open cut (`freeze_owner`,
/// `freeze_pool`) whose hashes are still to be read, and the hashes of
/// those a change reached first, kept as they were: the cut costs a mark
/// a unit, and a copy only of what changes before it is read.
#[derive(Default)]
struct Frozen {
    tiers: HashSet<(usize, usize)>,
    pools: HashSet<i64>,
    kept_tiers: HashMap<(usize, usize), Vec<u64>>,
    kept_pools: HashMap<i64, Vec<u64>>,
}

impl Frozen {
    /// Before `held` (an owner's tier) changes or goes (inline: the lane
    /// calls it for every hash, and no cut is open nearly always).
    #[inline]
    fn keep_tier(&mut self, slot: usize, tier: usize, held: &SeqSet) {
        if !self.tiers.is_empty() {
            self.keep_frozen_tier(slot, tier, held);
        }
    }

    #[inline(never)]
    fn keep_frozen_tier(&mut self, slot: usize, tier: usize, held: &SeqSet) {
        if self.tiers.remove(&(slot, tier)) {
            self.kept_tiers.insert((slot, tier), held.iter().copied().collect());
        }
    }

    /// Before `held` (a pool store's blocks) changes or goes.
    fn keep_pool(&mut self, pid: i64, held: &SeqSet) {
        if !self.pools.is_empty() && self.pools.remove(&pid) {
            self.kept_pools.insert(pid, held.iter().copied().collect());
        }
    }
}

/// A namespace's blocks: what `BlockStore` guards.
pub(crate) struct Store {
    cat: Catalog,
    /// Per tier, per 64-slot word: identity -> the word's owner bits.
    masks: [Vec<CountMap>; TIERS],
    pool_counts: [CountMap; TIERS],
    owners: HashMap<usize, Owner>,
    pools: HashMap<i64, Pool>,
    frozen: Frozen,
}

fn no_owner(slot: usize) -> PyErr {
    PyKeyError::new_err(slot)
}

fn no_pool(pid: i64) -> PyErr {
    PyKeyError::new_err(pid)
}

impl Store {
    fn owner(&self, slot: usize) -> PyResult<&Owner> {
        self.owners.get(&slot).ok_or_else(|| no_owner(slot))
    }

    fn pool(&self, pid: i64) -> PyResult<&Pool> {
        self.pools.get(&pid).ok_or_else(|| no_pool(pid))
    }

    fn cut_open(&self) -> PyResult<()> {
        if self.cat.cuts == 0 {
            return Err(PyAssertionError::new_err("no cut is open"));
        }
        Ok(())
    }

    /// The catalog and an owner's tier as a `Holder`.
    fn owner_tier(&mut self, slot: usize, tier: usize) -> PyResult<(&mut Catalog, OwnerTier<'_>)> {
        let tier = tier_ix(tier)?;
        let owner = self.owners.get_mut(&slot).ok_or_else(|| no_owner(slot))?;
        self.frozen.keep_tier(slot, tier, &owner.tiers[tier]);
        let h = OwnerTier {
            set: &mut owner.tiers[tier],
            masks: &mut self.masks[tier][slot >> 6],
            dups: &mut owner.dups,
            tier: tier as u8,
            bit: 1u64 << (slot & 63),
        };
        Ok((&mut self.cat, h))
    }

    fn pool_blocks<'s, 'py>(
        &'s mut self,
        pid: i64,
        placed_out: Option<&'s Bound<'py, PyList>>,
    ) -> PyResult<(&'s mut Catalog, PoolBlocks<'s, 'py>)> {
        let pool = self.pools.get_mut(&pid).ok_or_else(|| no_pool(pid))?;
        self.frozen.keep_pool(pid, &pool.blocks);
        let h = PoolBlocks { set: &mut pool.blocks, counts: &mut self.pool_counts[pool.tier], placed_out };
        Ok((&mut self.cat, h))
    }

    fn export_seqs<'py>(py: Python<'py>, held: &SeqSet) -> Bound<'py, PyBytes> {
        pack(py, held.iter().copied())
    }

    fn export<'py>(&self, py: Python<'py>, held: &SeqSet) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let idents = pack(py, held.iter().map(|&s| self.cat.held_ident(s)));
        (Self::export_seqs(py, held), idents)
    }

    /// The walk of `PyBlockStore._match`: the listed 64-slot words walk the
    /// prompt together, a chunk of blocks at a time, so that every word's
    /// probes of a chunk are in flight at once (see `GATHER`).
    fn matched(&self, prompt: &mut Prompt<'_, '_>, listed: &Bound<'_, PyAny>) -> PyResult<Vec<(usize, u32, u32, u32)>> {
        let pool_host = Some(&self.pool_counts[HOST]).filter(|m| !m.is_empty());
        let pool_disk = Some(&self.pool_counts[DISK]).filter(|m| !m.is_empty());
        let mut words: Vec<Word<'_>> = int_words(listed)?
            .into_iter()
            .enumerate()
            .filter(|&(_, l)| l != 0)
            .map(|(w, l)| Word {
                w,
                listed: l,
                dev: self.word_masks(DEVICE, w),
                host: self.word_masks(HOST, w),
                disk: self.word_masks(DISK, w),
                g: l,
                c: l,
                d: l,
                ends: [[0; 64]; 3],
                got: [(0, 0); GATHER],
            })
            .collect();
        let mut i = 0;
        loop {
            let ids = prompt.chunk(i)?;
            if ids.is_empty() || words.iter().all(|w| w.d == 0) {
                break;
            }
            for word in words.iter().filter(|w| w.d != 0) {
                for &id in ids {
                    prefetch(word.dev, id);
                }
            }
            // A prefix that pools extend keeps every owner needing the
            // pool's answer, block after block, in every word; where a
            // host pool serves a block, no owner's host tier can add to
            // it, so those blocks' host probes are not made (at 4.3M
            // entries they were a third of the probes of a long hit).
            for &id in ids {
                prefetch(pool_host, id);
            }
            let mut in_pool = [false; GATHER];
            for (p, &id) in in_pool.iter_mut().zip(ids) {
                *p = pooled(pool_host, id);
            }
            for word in words.iter().filter(|w| w.d != 0) {
                for (&p, &id) in in_pool.iter().zip(ids) {
                    if !p {
                        prefetch(word.host, id);
                    }
                }
            }
            for word in words.iter_mut().filter(|w| w.d != 0) {
                for ((m, &p), &id) in word.got.iter_mut().zip(&in_pool).zip(ids) {
                    *m = (probe(word.dev, id), if p { 0 } else { probe(word.host, id) });
                }
                word.step(ids, i, &in_pool, pool_disk);
            }
            i += ids.len();
        }
        let mut out = Vec::with_capacity(words.iter().map(|w| w.listed.count_ones() as usize).sum());
        for word in &mut words {
            let (g, c, d) = (word.g, word.c, word.d);
            ended(g, i, &mut word.ends[0]);
            ended(c, i, &mut word.ends[1]);
            ended(d, i, &mut word.ends[2]);
            let mut bits = word.listed;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                let e = &word.ends;
                out.push((word.w * 64 + b, e[0][b], e[1][b], e[2][b]));
                bits &= bits - 1;
            }
        }
        Ok(out)
    }

    fn word_masks(&self, tier: usize, w: usize) -> Option<&CountMap> {
        self.masks[tier].get(w).filter(|m| !m.is_empty())
    }
}

/// One 64-slot word's walk: its maps and its still-matching owners of each
/// tier as bits (g ⊆ c ⊆ d).
struct Word<'a> {
    w: usize,
    listed: u64,
    dev: Option<&'a CountMap>,
    host: Option<&'a CountMap>,
    disk: Option<&'a CountMap>,
    g: u64,
    c: u64,
    d: u64,
    ends: Ends,
    /// The chunk's (device, own host) masks, gathered.
    got: [(u64, u64); GATHER],
}

impl Word<'_> {
    /// Blocks `at..` (`ids`), their device and host masks in `got` (host 0
    /// where a host pool holds the block: `in_pool`). The rarer probes are
    /// made only where they can change an outcome: disk for owners off
    /// both, the disk pool only where the owner maps leave some owner
    /// unserved. With device tiers only, CPU and DISK equal GPU.
    fn step(&mut self, ids: &[u64], at: usize, in_pool: &[bool; GATHER], pool_disk: Option<&CountMap>) {
        let (mut g, mut c, mut d) = (self.g, self.c, self.d);
        for (j, ((&(dm, h), &id), &p)) in self.got.iter().zip(ids).zip(in_pool).enumerate() {
            let ng = g & dm;
            // Owners that need a lower tier for this block.
            let need = d & !ng;
            let (nc, nd) = if need == 0 || p || need & !h == 0 {
                (c, d)
            } else {
                let k = h | probe(self.disk, id);
                let nd = if need & !k == 0 || pooled(pool_disk, id) { d } else { ng | (d & k) };
                (ng | (c & h), nd)
            };
            if ng != g {
                ended(g ^ ng, at + j, &mut self.ends[0]);
                g = ng;
            }
            if nc != c {
                ended(c ^ nc, at + j, &mut self.ends[1]);
                c = nc;
            }
            if nd != d {
                ended(d ^ nd, at + j, &mut self.ends[2]);
                d = nd;
                if d == 0 {
                    break;
                }
            }
        }
        (self.g, self.c, self.d) = (g, c, d);
    }
}

impl Store {
    pub(crate) fn now(&self) -> f64 {
        self.cat.now
    }

    /// The owner at `slot` as the engine lane changes it (`LaneOwner`).
    pub(crate) fn lane_owner(&mut self, slot: usize) -> Option<LaneOwner<'_>> {
        let owner = self.owners.get_mut(&slot)?;
        let w = slot >> 6;
        let [dev, host, disk] = &mut self.masks;
        Some(LaneOwner {
            cat: &mut self.cat,
            tiers: &mut owner.tiers,
            dups: &mut owner.dups,
            masks: [&mut dev[w], &mut host[w], &mut disk[w]],
            frozen: &mut self.frozen,
            slot,
        })
    }
}

/// What the engine lane (`lane.rs`) does to one owner: `place_owner` and
/// `remove_owner` split in two, so that a record applies whole or not at
/// all without a dry run that probes every hash before the apply probes it
/// again. The tier sets change first (`insert`, `remove`, each undone by
/// the other; nothing reads them in between), then, once the whole record
/// is known to apply, the catalog and the masks follow in the record's
/// order (`acquire`, `release`).
pub(crate) struct LaneOwner<'s> {
    cat: &'s mut Catalog,
    tiers: &'s mut [SeqSet; TIERS],
    dups: &'s mut HashMap<(u8, u64), u32>,
    /// The owner's 64-slot word of each tier's masks.
    masks: [&'s mut CountMap; TIERS],
    frozen: &'s mut Frozen,
    slot: usize,
}

impl LaneOwner<'_> {
    pub(crate) fn size(&self) -> usize {
        self.tiers.iter().map(SeqSet::len).sum()
    }

    /// Whether the tier did not hold `seq` (now it does).
    pub(crate) fn insert(&mut self, tier: usize, seq: u64) -> bool {
        self.frozen.keep_tier(self.slot, tier, &self.tiers[tier]);
        self.tiers[tier].insert(seq)
    }

    /// Whether the tier held `seq` (now it does not).
    pub(crate) fn remove(&mut self, tier: usize, seq: u64) -> bool {
        self.frozen.keep_tier(self.slot, tier, &self.tiers[tier]);
        self.tiers[tier].remove(&seq)
    }

    pub(crate) fn content(&self, seq: u64) -> Option<u64> {
        self.cat.ident(seq)
    }

    /// Asks for the cache lines of `seq` in the tier and the catalog: at
    /// hundreds of thousands of blocks each probe is likely a miss, and a
    /// record's hashes asked for together overlap them.
    #[inline]
    pub(crate) fn prefetch(&self, tier: usize, seq: u64) {
        self.tiers[tier].prefetch(seq);
        self.cat.map.prefetch(seq);
    }

    /// Asks for the cache line of content `ident` in the tier's masks.
    #[inline]
    pub(crate) fn prefetch_mask(&self, tier: usize, ident: u64) {
        self.masks[tier].prefetch(ident);
    }

    /// The content of `seq` when some tier or pool holds it (held content
    /// is never expired or evicted, unlike retired content).
    pub(crate) fn held_content(&self, seq: u64) -> Option<u64> {
        self.cat.map.get(&seq).filter(|b| b.refs > 0).map(|b| b.ident)
    }

    /// `NamespaceIndex.touch` then `expire`, as a store's namespace is
    /// fetched before each store event (`touch` moves the clock forward only).
    pub(crate) fn touch_expire(&mut self, now: f64) {
        if now > self.cat.now {
            self.cat.now = now;
        }
        let now = self.cat.now;
        self.cat.expire(now);
    }

    fn holder(&mut self, tier: usize) -> OwnerTier<'_> {
        OwnerTier {
            set: &mut self.tiers[tier],
            masks: &mut *self.masks[tier],
            dups: &mut *self.dups,
            tier: tier as u8,
            bit: 1u64 << (self.slot & 63),
        }
    }

    /// The catalog and masks of `seq`, inserted into the tier with
    /// content `ident`; whether the catalog knew other content for it (a
    /// hash conflict: its content stays).
    pub(crate) fn acquire(&mut self, tier: usize, seq: u64, ident: u64) -> PyResult<bool> {
        let canon = self.cat.acquire(seq, ident);
        self.holder(tier).count(seq, canon)?;
        Ok(canon != ident)
    }

    /// The catalog and masks of `seq`, removed from the tier.
    pub(crate) fn release(&mut self, tier: usize, seq: u64) -> PyResult<()> {
        let ident = self.cat.release(seq)?;
        self.holder(tier).uncount(ident);
        Ok(())
    }
}

/// `kvconductor.index.block_store.PyBlockStore`, compiled. Frozen, with
/// its blocks behind a lock: the engine lane applies records with the GIL
/// released (`EngineLane.run_free`, one record a hold) while queries and
/// snapshots take the lock on the event loop's thread.
#[pyclass(module = "kvconductor._kernel", frozen)]
pub struct BlockStore {
    state: Mutex<Store>,
}

impl BlockStore {
    /// A panic under the lock (a bug) left the store as it was then; the
    /// next call still gets it.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Store> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl BlockStore {
    #[new]
    fn new(max_retired: usize, max_age_s: f64) -> Self {
        let store = Store {
            cat: Catalog::new(max_retired, max_age_s),
            masks: [Vec::new(), Vec::new(), Vec::new()],
            pool_counts: Default::default(),
            owners: HashMap::new(),
            pools: HashMap::new(),
            frozen: Frozen::default(),
        };
        BlockStore { state: Mutex::new(store) }
    }

    // ------------------------------------------------------------- catalog

    fn set_now(&self, now: f64) {
        let mut this = self.lock();
        this.cat.now = now;
    }

    fn ident(&self, seq: u64) -> Option<u64> {
        let this = self.lock();
        this.cat.ident(seq)
    }

    fn identities_of(&self, seqs: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let this = self.lock();
        Ok(u64s(seqs)?.into_iter().map_while(|s| this.cat.ident(s)).collect())
    }

    fn acquire(&self, seq: u64, ident: u64) -> u64 {
        let mut this = self.lock();
        this.cat.acquire(seq, ident)
    }

    fn release(&self, seq: u64) -> PyResult<()> {
        let mut this = self.lock();
        this.cat.release(seq).map(drop)
    }

    fn remember(&self, seq: u64, ident: u64) {
        let mut this = self.lock();
        let now = this.cat.now;
        this.cat.retire_new(seq, ident, now);
    }

    fn pool_holds(&self, ident: u64) -> bool {
        let this = self.lock();
        this.pool_counts[HOST].contains(ident) || this.pool_counts[DISK].contains(ident)
    }

    fn content_len(&self) -> usize {
        let this = self.lock();
        this.cat.map.len()
    }

    // ------------------------------------------------------------- retired

    fn expire(&self, now: f64) {
        let mut this = self.lock();
        this.cat.expire(now);
    }

    fn retired_len(&self) -> usize {
        let this = self.lock();
        this.cat.live
    }

    fn retired_version(&self) -> u64 {
        let this = self.lock();
        this.cat.version
    }

    fn export_retired<'py>(&self, py: Python<'py>) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let this = self.lock();
        let items: Vec<(u64, u64, f64)> = this.cat.retired().collect();
        // An f64's little-endian bytes are its bit pattern's.
        (
            pack(py, items.iter().map(|r| r.0)),
            pack(py, items.iter().map(|r| r.1)),
            pack(py, items.iter().map(|r| r.2.to_bits())),
        )
    }

    fn load_retired(&self, seqs: &[u8], idents: &[u8], ts: &[u8]) -> PyResult<()> {
        let mut this = self.lock();
        let (seqs, idents, ts) = (unpack(seqs)?, unpack(idents)?, unpack(ts)?);
        if idents.len() != seqs.len() || ts.len() != seqs.len() {
            return Err(PyValueError::new_err("retired arrays of different lengths"));
        }
        for ((seq, ident), at) in seqs.into_iter().zip(idents).zip(ts) {
            this.cat.retire_new(seq, ident, f64::from_bits(at));
        }
        Ok(())
    }

    fn clear_retired(&self) {
        let mut this = self.lock();
        this.cat.clear_retired();
    }

    // ----------------------------------------------------------------- cuts

    fn begin_cut(&self) {
        let mut this = self.lock();
        let cat = &mut this.cat;
        cat.cuts += 1;
        cat.forgotten.get_or_insert_with(HashMap::new);
    }

    fn end_cut(&self) -> PyResult<()> {
        let mut this = self.lock();
        let cat = &mut this.cat;
        if cat.cuts == 0 {
            return Err(PyAssertionError::new_err("end_cut without begin_cut"));
        }
        cat.cuts -= 1;
        if cat.cuts == 0 {
            cat.forgotten = None;
            this.frozen = Frozen::default();
        }
        Ok(())
    }

    fn freeze_owner(&self, slot: usize) -> PyResult<()> {
        let mut this = self.lock();
        this.cut_open()?;
        this.owner(slot)?;
        for tier in [DEVICE, HOST, DISK] {
            this.frozen.kept_tiers.remove(&(slot, tier));
            this.frozen.tiers.insert((slot, tier));
        }
        Ok(())
    }

    fn cut_owner_seqs<'py>(&self, py: Python<'py>, slot: usize, tier: usize) -> PyResult<Bound<'py, PyBytes>> {
        let mut this = self.lock();
        let tier = tier_ix(tier)?;
        if let Some(kept) = this.frozen.kept_tiers.remove(&(slot, tier)) {
            return Ok(pack(py, kept.into_iter()));
        }
        if !this.frozen.tiers.remove(&(slot, tier)) {
            return Err(PyAssertionError::new_err("owner tier not frozen at this cut"));
        }
        Ok(Store::export_seqs(py, &this.owner(slot)?.tiers[tier]))
    }

    fn freeze_pool(&self, pid: i64) -> PyResult<()> {
        let mut this = self.lock();
        this.cut_open()?;
        this.pool(pid)?;
        this.frozen.kept_pools.remove(&pid);
        this.frozen.pools.insert(pid);
        Ok(())
    }

    fn cut_pool_seqs<'py>(&self, py: Python<'py>, pid: i64) -> PyResult<Bound<'py, PyBytes>> {
        let mut this = self.lock();
        if let Some(kept) = this.frozen.kept_pools.remove(&pid) {
            return Ok(pack(py, kept.into_iter()));
        }
        if !this.frozen.pools.remove(&pid) {
            return Err(PyAssertionError::new_err("pool not frozen at this cut"));
        }
        Ok(Store::export_seqs(py, &this.pool(pid)?.blocks))
    }

    fn cut_identities<'py>(&self, py: Python<'py>, seqs: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let this = self.lock();
        let cat = &this.cat;
        let Some(kept) = &cat.forgotten else {
            return Err(PyAssertionError::new_err("no cut is open"));
        };
        let seqs = unpack(seqs)?;
        let mut idents = Vec::with_capacity(seqs.len());
        for seq in seqs {
            match kept.get(&seq).copied().or_else(|| cat.ident(seq)) {
                Some(ident) => idents.push(ident),
                None => return Err(PyKeyError::new_err(seq)),
            }
        }
        Ok(pack(py, idents.into_iter()))
    }

    fn retired_limit(&self) -> usize {
        let this = self.lock();
        this.cat.max_entries
    }

    fn set_retired_limit(&self, limit: usize) {
        let mut this = self.lock();
        this.cat.max_entries = limit;
    }

    // -------------------------------------------------------------- owners

    fn add_owner(&self, slot: usize) -> PyResult<()> {
        let mut this = self.lock();
        if slot >= MAX_SLOTS {
            return Err(PyValueError::new_err("owner slot out of range"));
        }
        for m in &mut this.masks {
            if m.len() <= slot >> 6 {
                m.resize_with((slot >> 6) + 1, CountMap::default);
            }
        }
        let owner = Owner { tiers: Default::default(), dups: HashMap::new() };
        this.owners.insert(slot, owner);
        Ok(())
    }

    fn drop_owner(&self, slot: usize) -> PyResult<()> {
        let mut this = self.lock();
        let owner = this.owners.remove(&slot).ok_or_else(|| no_owner(slot))?;
        for (tier, held) in owner.tiers.iter().enumerate() {
            this.frozen.keep_tier(slot, tier, held);
        }
        Ok(())
    }

    fn owner_size(&self, slot: usize) -> PyResult<usize> {
        let this = self.lock();
        Ok(this.owner(slot)?.tiers.iter().map(SeqSet::len).sum())
    }

    fn tier_len(&self, slot: usize, tier: usize) -> PyResult<usize> {
        let this = self.lock();
        Ok(this.owner(slot)?.tiers[tier_ix(tier)?].len())
    }

    fn count_new(&self, slot: usize, tier: usize, seqs: &Bound<'_, PyAny>) -> PyResult<usize> {
        let this = self.lock();
        let held = &this.owner(slot)?.tiers[tier_ix(tier)?];
        Ok(u64s(seqs)?.iter().filter(|s| !held.contains(s)).count())
    }

    fn place_owner(
        &self,
        slot: usize,
        tier: usize,
        seqs: &Bound<'_, PyAny>,
        idents: Option<&Bound<'_, PyAny>>,
        room: &Bound<'_, PyAny>,
    ) -> PyResult<Placed> {
        let mut this = self.lock();
        let (seqs, idents, room) = (u64s(seqs)?, idents.map(u64s).transpose()?, room_of(room)?);
        let (cat, mut h) = this.owner_tier(slot, tier)?;
        place(cat, &mut h, &seqs, idents.as_deref(), room)
    }

    fn remove_owner(&self, slot: usize, tier: usize, seqs: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let mut this = self.lock();
        let seqs = u64s(seqs)?;
        let (cat, mut h) = this.owner_tier(slot, tier)?;
        let mut missing = Vec::new();
        for seq in seqs {
            if !unplace(cat, &mut h, seq)? {
                missing.push(seq);
            }
        }
        Ok(missing)
    }

    fn clear_owner(&self, slot: usize) -> PyResult<usize> {
        let mut this = self.lock();
        let mut removed = 0;
        for tier in [DEVICE, HOST, DISK] {
            let (cat, mut h) = this.owner_tier(slot, tier)?;
            removed += clear(cat, &mut h)?;
        }
        Ok(removed)
    }

    fn export_owner<'py>(
        &self,
        py: Python<'py>,
        slot: usize,
        tier: usize,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let this = self.lock();
        Ok(this.export(py, &this.owner(slot)?.tiers[tier_ix(tier)?]))
    }

    fn load_owner(&self, slot: usize, tier: usize, seqs: &[u8], idents: &[u8]) -> PyResult<()> {
        let mut this = self.lock();
        let (cat, mut h) = this.owner_tier(slot, tier)?;
        let empty = h.set.is_empty();
        load(cat, &mut h, empty, seqs, idents, "tier")
    }

    // --------------------------------------------------------------- pools

    fn add_pool(&self, pid: i64, tier: usize) -> PyResult<()> {
        let mut this = self.lock();
        let tier = tier_ix(tier)?;
        this.pools.insert(pid, Pool { tier, blocks: SeqSet::default() });
        Ok(())
    }

    fn drop_pool(&self, pid: i64) -> PyResult<()> {
        let mut this = self.lock();
        let pool = this.pools.remove(&pid).ok_or_else(|| no_pool(pid))?;
        this.frozen.keep_pool(pid, &pool.blocks);
        Ok(())
    }

    fn pool_len(&self, pid: i64) -> PyResult<usize> {
        let this = self.lock();
        Ok(this.pool(pid)?.blocks.len())
    }

    #[pyo3(signature = (pid, seqs, idents, room, placed_out))]
    fn place_pool(
        &self,
        pid: i64,
        seqs: &Bound<'_, PyAny>,
        idents: Option<&Bound<'_, PyAny>>,
        room: &Bound<'_, PyAny>,
        placed_out: Option<&Bound<'_, PyList>>,
    ) -> PyResult<Placed> {
        let mut this = self.lock();
        let (seqs, idents, room) = (u64s(seqs)?, idents.map(u64s).transpose()?, room_of(room)?);
        let (cat, mut h) = this.pool_blocks(pid, placed_out)?;
        place(cat, &mut h, &seqs, idents.as_deref(), room)
    }

    fn remove_pool(&self, pid: i64, seq: u64) -> PyResult<bool> {
        let mut this = self.lock();
        let (cat, mut h) = this.pool_blocks(pid, None)?;
        unplace(cat, &mut h, seq)
    }

    fn clear_pool(&self, pid: i64) -> PyResult<usize> {
        let mut this = self.lock();
        let (cat, mut h) = this.pool_blocks(pid, None)?;
        clear(cat, &mut h)
    }

    fn export_pool<'py>(&self, py: Python<'py>, pid: i64) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let this = self.lock();
        Ok(this.export(py, &this.pool(pid)?.blocks))
    }

    fn load_pool(&self, pid: i64, seqs: &[u8], idents: &[u8]) -> PyResult<()> {
        let mut this = self.lock();
        let (cat, mut h) = this.pool_blocks(pid, None)?;
        let empty = h.set.is_empty();
        load(cat, &mut h, empty, seqs, idents, "pool")
    }

    // --------------------------------------------------------------- query

    /// The walk over packed u32 tokens, hashed block by block as far as
    /// it goes (a trailing partial block is not a block). `listed` says
    /// which 64-slot words to walk.
    #[pyo3(signature = (data, block_size, seed, listed))]
    fn match_tokens(
        &self,
        data: &[u8],
        block_size: usize,
        seed: u64,
        listed: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, u32, u32, u32)>> {
        let this = self.lock();
        let step = block_size
            .checked_mul(4)
            .filter(|s| *s > 0)
            .ok_or_else(|| PyValueError::new_err("block_size must be a positive integer"))?;
        let len = data.len() / step;
        let source = Source::Tokens { data, step, ident: seed };
        let mut prompt = Prompt { source, idents: Vec::with_capacity(len), len };
        this.matched(&mut prompt, listed)
    }

    #[pyo3(signature = (idents, listed))]
    fn match_identities(
        &self,
        idents: &Bound<'_, PyAny>,
        listed: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, u32, u32, u32)>> {
        let this = self.lock();
        let mut prompt = if let Ok(list) = idents.cast::<PyList>() {
            let len = list.len();
            Prompt { source: Source::List(list), idents: Vec::with_capacity(len), len }
        } else {
            let given = u64s(idents)?;
            Prompt { source: Source::Given, len: given.len(), idents: given }
        };
        this.matched(&mut prompt, listed)
    }

    /// `shape.shape_json(match_tokens(...))`, the lengths never made
    /// Python objects.
    #[pyo3(signature = (data, block_size, seed, listed, shape))]
    fn match_tokens_json<'py>(
        &self,
        data: &[u8],
        block_size: usize,
        seed: u64,
        listed: &Bound<'py, PyAny>,
        shape: &Bound<'py, AnswerShape>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        answer_json(shape, self.match_tokens(data, block_size, seed, listed)?)
    }

    /// `shape.shape_json(match_identities(...))`, likewise.
    #[pyo3(signature = (idents, listed, shape))]
    fn match_identities_json<'py>(
        &self,
        idents: &Bound<'py, PyAny>,
        listed: &Bound<'py, PyAny>,
        shape: &Bound<'py, AnswerShape>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        answer_json(shape, self.match_identities(idents, listed)?)
    }

    // --------------------------------------------------------------- tests

    /// Every map as `PyBlockStore.dump` gives it.
    fn dump<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let this = self.lock();
        let cat = &this.cat;
        let content = PyDict::new(py);
        let refs = PyDict::new(py);
        for (seq, b) in cat.map.iter() {
            content.set_item(seq, b.ident)?;
            if b.refs > 0 {
                refs.set_item(seq, b.refs)?;
            }
        }
        let retired: Vec<(u64, f64)> = cat.retired().map(|(s, _, ts)| (s, ts)).collect();
        let masks = PyList::empty(py);
        for tier in &this.masks {
            let mut joined: HashMap<u64, Vec<u64>> = HashMap::new();
            for (w, word) in tier.iter().enumerate() {
                for (ident, bits) in word.iter() {
                    joined.entry(ident).or_insert_with(|| vec![0; tier.len()])[w] = bits;
                }
            }
            let d = PyDict::new(py);
            for (ident, words) in joined {
                d.set_item(ident, words_int(py, &words)?)?;
            }
            masks.append(d)?;
        }
        let pool_counts = PyList::empty(py);
        for counts in &this.pool_counts {
            pool_counts.append(counts.iter().collect::<std::collections::HashMap<_, _>>())?;
        }
        let held = |set: &SeqSet| -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            for &seq in set {
                d.set_item(seq, cat.held_ident(seq))?;
            }
            Ok(d)
        };
        let owners = PyDict::new(py);
        for (slot, o) in &this.owners {
            let tiers = PyList::empty(py);
            for t in &o.tiers {
                tiers.append(held(t)?)?;
            }
            let dups: std::collections::HashMap<_, _> = o.dups.iter().collect();
            owners.set_item(slot, (tiers, dups))?;
        }
        let pools = PyDict::new(py);
        for (pid, p) in &this.pools {
            pools.set_item(pid, (p.tier, held(&p.blocks)?))?;
        }
        let out = PyDict::new(py);
        out.set_item("content", content)?;
        out.set_item("refs", refs)?;
        out.set_item("retired", retired)?;
        out.set_item("masks", masks)?;
        out.set_item("pool_counts", pool_counts)?;
        out.set_item("owners", owners)?;
        out.set_item("pools", pools)?;
        Ok(out)
    }
}
