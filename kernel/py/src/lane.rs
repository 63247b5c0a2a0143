//! The engine lane: a batch of Kafka records applied straight to the
//! namespaces' block stores, with no Python per record or event, for the
//! records real engines send most (see `kvconductor/index/engine_lane.py`, which
//! drives it, and docs/index-design.md "The engine lane").
//!
//! `run` takes records in order and stops at the first one it cannot apply
//! exactly as the Python path would (`Index.apply_engine`): a payload
//! outside `engine_wire`'s subset, a record whose instance, namespace or
//! owner has no context yet (`NEED_CONTEXT`: the caller builds one or
//! applies the record itself), or any event that would need the Python
//! path's rules (copies, a pending half completed, cancelled or expired,
//! groups, a new or emptied owner,
//! capacity, an unknown medium, a parent or a token-less store's content
//! the store does not hold...).
//! A record applies whole or not at all (`kvconductor_core::ingest::apply`,
//! over `kvconductor_core::store::LaneOwner`): its events change the
//! owner's tier sets as they are checked, one probe a hash, and are undone
//! there at the first event the lane cannot apply; only a record that got
//! through goes on to the catalog and masks. A record the lane stops at is
//! left untouched and the caller applies it the Python way. This file is
//! what needs Python: reading the records, the contexts and their pending
//! halves (Python dicts), the mediums' tiers (`media.engine_tier`), and
//! handing counters and clocks back.
//!
//! A context holds what the Python path would look up for each record of
//! one instance, header set and rank: the owner's slot in its namespace's
//! store, and the facts that make the lane exact for it (no copies, no
//! groups, one namespace, the primary block size). They stay true while
//! only the lane applies that instance's records; the caller forgets an
//! instance's contexts whenever it applies one of its records itself, and
//! all of them when the index changes another way. The namespace's pending
//! halves are read live: the lane never adds to them, everything else may.
//!
//! `run_free` is `run` on another thread than the event loop's: it reads
//! its records with the GIL, then releases it to decode and apply them,
//! each store locked for one record at a time (`store::BlockStore` is a
//! lock around its blocks), so a query on the event loop waits for one
//! record at most. Whatever needs the GIL (a medium not seen yet, pending
//! halves in the namespace, read before it releases the GIL) ends the run
//! there (`GIL`) for `run` to apply that record. It never holds the GIL and
//! a store's lock together: the event loop's thread takes a store's lock
//! with the GIL held.

use hashbrown::HashMap;
use kvconductor_core::ingest::apply::{self, Pending, Rules};
use kvconductor_core::ingest::engine_wire::{self, Event};
use kvconductor_core::store::TIERS;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple};

use crate::store::{store_err, BlockStore};

/// Why `run` stopped: every record applied, record `stop` needs a context,
/// or record `stop` is the Python path's.
const DONE: u8 = 0;
const NEED_CONTEXT: u8 = 1;
const PYTHON: u8 = 2;
/// `run_free` only: record `stop` needs the GIL (a medium not seen yet,
/// pending halves in its namespace): `run` applies it.
const GIL: u8 = 3;

/// Mediums whose tier is remembered (as `media.engine_tier` caches them).
const MAX_MEDIUMS: usize = 16;

struct Ctx {
    id: usize,
    sig: Vec<u8>,
    store: Py<BlockStore>,
    /// The namespace's pending halves: `PendingQueue.entries` (key ->
    /// arrival time, oldest first) and what its blocks wait for
    /// (`waiting`, `children`, `unresolved`, keyed by sequence hash).
    pending: Py<PyDict>,
    waiting: Py<PyDict>,
    children: Py<PyDict>,
    unresolved: Py<PyDict>,
    max_pending_age: f64,
    slot: usize,
    block_size: usize,
    seed: u64,
    max_blocks: usize,
    pool_mode: bool,
    /// The instance may re-announce held blocks (`kv-report-mode: full`).
    reannounces: bool,
    kind0: Option<String>,
    rank: u32,
    applied: [u64; TIERS],
    /// Tiers stored to since the last `run` returned, a bit each.
    stored: u8,
    touched: bool,
    /// The store's clock after the context's last record.
    store_now: f64,
    /// `run_free`: the namespace had pending halves when it began.
    busy: bool,
}

struct Inst {
    name: Py<PyString>,
    ctxs: Vec<usize>,
    last_ts: f64,
    touched: bool,
    /// Rank -> (last `kv-seq`, changed since the last `run` returned).
    seqs: HashMap<u32, (Option<u64>, bool)>,
}

/// Counters the lane moves, in `COUNTER_NAMES` order.
const HASH_CONFLICTS: usize = 0;
const REMOVAL_UNKNOWN: usize = 1;
const SEQ_GAPS: usize = 2;
const SEQ_MISSING: usize = 3;
const SEQ_REGRESSIONS: usize = 4;
const COUNTER_NAMES: [&str; 5] = ["hash_conflicts", "removal_unknown", "seq_gaps", "seq_missing", "seq_regressions"];

/// One record, as read from its `core.Incoming`.
struct Rec<'a> {
    key: &'a [u8],
    seq: Option<u64>,
    now: f64,
    payload: &'a [u8],
}

type CtxOut = (usize, [u64; TIERS], u8, f64);
type InstOut = (Py<PyString>, f64, Vec<(u32, u64)>);
type RunOut =
    (usize, u8, Option<u64>, f64, Vec<(&'static str, u64)>, Vec<(usize, usize, u64)>, Vec<CtxOut>, Vec<InstOut>);

/// `EngineLane::window`'s bounds.
const MIN_WINDOW: usize = 16;
const MAX_WINDOW: usize = 1 << 16;

#[pyclass(module = "kvconductor._kernel")]
pub struct EngineLane {
    full_kinds: Vec<String>,
    engine_tier: Py<PyAny>,
    /// (medium, tier) as `media.engine_tier` answered: a handful, scanned.
    mediums: Vec<(Option<String>, Option<usize>)>,
    by_sig: HashMap<Vec<u8>, usize>,
    ctxs: Vec<Option<Ctx>>,
    free: Vec<usize>,
    insts: HashMap<Vec<u8>, Inst>,
    /// The signature and instance of the record `run` last stopped at for a context.
    miss: Option<(Vec<u8>, Vec<u8>)>,
    sig: Vec<u8>,
    /// Records `run_free` reads ahead: twice what the last call got
    /// through. Reading the whole rest of a batch at every call made a
    /// batch whose records stop the lane often quadratic in its length.
    window: usize,
    spare: engine_wire::Spare,
    /// A record's event tiers.
    tiers: Vec<usize>,
    work: Work,
    touched: Vec<usize>,
    gaps: Vec<(usize, usize, u64)>,
}

/// A record's scratch space (`kvconductor_core::ingest::apply::Work`) and
/// the counters it moves, apart from the contexts: applying borrows one
/// context and these together.
#[derive(Default)]
struct Work {
    apply: apply::Work,
    counters: [u64; 5],
}

/// How `step` left a record.
enum Step {
    Applied,
    /// No context: the payload's dp rank.
    NeedContext(Option<u64>),
    Python,
    Gil,
}

/// `records._int` for `kv-seq`, on the values engines write: ASCII digits.
/// Anything else (signs, spaces, underscores, out of range) is the
/// Python path's, which accepts or names it.
fn seq_value(raw: &[u8]) -> Option<Option<u64>> {
    if raw.is_empty() {
        return Some(None);
    }
    if raw.len() > 20 || !raw.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(raw).ok()?.parse::<u64>().ok().map(Some)
}

fn push_field(sig: &mut Vec<u8>, field: Option<&[u8]>) {
    match field {
        Some(f) => {
            sig.extend_from_slice(&(f.len() as u32).to_le_bytes());
            sig.extend_from_slice(f);
        }
        None => sig.extend_from_slice(&u32::MAX.to_le_bytes()),
    }
}

/// Reads record `item` into `rec` and its signature (key, the `kv-*`
/// headers but `kv-seq`, in order) into `sig`; None: the Python path's.
fn read_record<'a>(item: &'a Bound<'_, PyAny>, sig: &mut Vec<u8>) -> PyResult<Option<Rec<'a>>> {
    let Ok(t) = item.cast::<PyTuple>() else { return Ok(None) };
    if t.len() != 5 || t.get_borrowed_item(0)?.is_truthy()? {
        return Ok(None); // a pool record
    }
    let (key, headers, value) = (t.get_borrowed_item(1)?, t.get_borrowed_item(2)?, t.get_borrowed_item(3)?);
    let (Ok(key), Ok(value)) = (key.cast::<PyBytes>(), value.cast::<PyBytes>()) else { return Ok(None) };
    // A float, as the Python path would keep it (an int clock stays an int there).
    let stamp = t.get_borrowed_item(4)?;
    let Ok(now) = stamp.cast::<PyFloat>().map(|f| f.value()) else { return Ok(None) };
    // SAFETY: bytes objects are immutable and the tuple keeps them alive
    // for as long as `item` is borrowed.
    let key: &'a [u8] = unsafe { std::slice::from_raw_parts(key.as_bytes().as_ptr(), key.as_bytes().len()) };
    let payload: &'a [u8] = unsafe { std::slice::from_raw_parts(value.as_bytes().as_ptr(), value.as_bytes().len()) };
    if std::str::from_utf8(key).is_err() {
        return Ok(None);
    }
    sig.clear();
    push_field(sig, Some(key));
    let mut seq = None;
    let Ok(headers) = headers.try_iter() else { return Ok(None) };
    for header in headers {
        let header = header?;
        let Ok(pair) = header.cast::<PyTuple>() else { return Ok(None) };
        if pair.len() != 2 {
            return Ok(None);
        }
        let name = pair.get_borrowed_item(0)?;
        let Ok(name) = name.cast::<PyString>() else { return Ok(None) };
        let Ok(name) = name.to_str() else { return Ok(None) };
        if !name.starts_with("kv-") {
            continue;
        }
        let value = pair.get_borrowed_item(1)?;
        let bytes = value.cast::<PyBytes>().ok();
        let raw: Option<&[u8]> = match &bytes {
            Some(b) => Some(b.as_bytes()),
            None if value.is_none() => None,
            None => return Ok(None),
        };
        if name == "kv-seq" {
            match seq_value(raw.unwrap_or_default()) {
                Some(v) => seq = v,
                None => return Ok(None),
            }
            continue;
        }
        push_field(sig, Some(name.as_bytes()));
        push_field(sig, raw);
    }
    Ok(Some(Rec { key, seq, now, payload }))
}

/// A namespace's pending halves, keyed by the hashes they wait on.
struct Waits<'a, 'py> {
    waiting: &'a Bound<'py, PyDict>,
    children: &'a Bound<'py, PyDict>,
    unresolved: &'a Bound<'py, PyDict>,
}

impl Waits<'_, '_> {
    /// Whether content learnt for `seq` would complete a pending half
    /// (`NamespaceIndex._learn`): the Python path's.
    fn learns(&self, seq: u64) -> PyResult<bool> {
        Ok(self.waiting.contains(seq)? || self.children.contains(seq)? || self.unresolved.contains(seq)?)
    }
}

/// A lookup that raised is the Python path's.
impl Pending for Waits<'_, '_> {
    fn learns(&self, seq: u64) -> bool {
        Waits::learns(self, seq).unwrap_or(true)
    }

    fn waits_on(&self, seq: u64) -> bool {
        self.waiting.contains(seq).unwrap_or(true)
    }
}

/// With pending halves in the context's namespace, what they wait for;
/// None: the namespace would expire one before the record's stores
/// (`NamespaceIndex.expire`), the Python path's.
fn waits<'a, 'py>(
    py: Python<'py>,
    ctx: &'a Ctx,
    rec_now: f64,
    now: f64,
    store_now: f64,
    events: &[Event<'_>],
) -> PyResult<Option<Option<Waits<'a, 'py>>>> {
    let pending = ctx.pending.bind(py);
    if pending.is_empty() {
        return Ok(Some(None));
    }
    let index_now = if rec_now > now { rec_now } else { now };
    let ns_now = if index_now > store_now { index_now } else { store_now };
    let oldest = pending.as_any().try_iter()?.next().transpose()?;
    if let Some(key) = oldest {
        let ts: f64 = pending.as_any().get_item(key)?.extract()?;
        let stores = events.iter().any(|e| matches!(e, Event::Stored(_)));
        // `PendingQueue.expire` keeps the head while `ts >= cutoff`
        // (so a NaN clock expires it).
        let kept = ts.partial_cmp(&(ns_now - ctx.max_pending_age)).is_some_and(|o| o.is_ge());
        if stores && !kept {
            return Ok(None);
        }
    }
    Ok(Some(Some(Waits {
        waiting: ctx.waiting.bind(py),
        children: ctx.children.bind(py),
        unresolved: ctx.unresolved.bind(py),
    })))
}

impl EngineLane {
    /// The tier of `medium` as `media.engine_tier` answered it, asked
    /// with the GIL (`py`) the first time; Err(()) without it: not known yet.
    fn tier(&mut self, py: Option<Python<'_>>, medium: Option<&str>) -> PyResult<Result<Option<usize>, ()>> {
        let is = |m: &Option<String>| match (m, medium) {
            (Some(m), Some(medium)) => engine_wire::same(m.as_bytes(), medium.as_bytes()),
            (m, medium) => m.is_none() && medium.is_none(),
        };
        if let Some((_, t)) = self.mediums.iter().find(|(m, _)| is(m)) {
            return Ok(Ok(*t));
        }
        let Some(py) = py else { return Ok(Err(())) };
        let t: Option<usize> = self.engine_tier.call1(py, (medium,))?.extract(py)?;
        if self.mediums.len() < MAX_MEDIUMS {
            self.mediums.push((medium.map(str::to_owned), t));
        }
        Ok(Ok(t))
    }

    /// Decodes and applies record `i` (`rec`, its signature so far in
    /// `sig`) whole, or says who must. `py`: None with the GIL released,
    /// when whatever needs it is left to `run` (`Step::Gil`).
    fn step(
        &mut self,
        py: Option<Python<'_>>,
        i: usize,
        rec: &Rec<'_>,
        sig: &mut Vec<u8>,
        now: &mut f64,
    ) -> PyResult<Step> {
        let Some(batch) = engine_wire::decode_with(rec.payload, &mut self.spare) else { return Ok(Step::Python) };
        match batch.dp_rank {
            Some(r) => {
                sig.push(1);
                sig.extend_from_slice(&r.to_le_bytes());
            }
            None => sig.push(0),
        }
        let Some(&c) = self.by_sig.get(sig.as_slice()) else {
            self.miss = Some((sig.clone(), rec.key.to_vec()));
            return Ok(Step::NeedContext(batch.dp_rank));
        };
        self.tiers.clear();
        for ev in &batch.events {
            let medium = match ev {
                Event::Stored(s) => s.medium,
                Event::Removed(r) => r.medium,
            };
            match self.tier(py, medium)? {
                Ok(Some(t)) if t < TIERS => self.tiers.push(t),
                Ok(_) => return Ok(Step::Python),
                Err(()) => return Ok(Step::Gil),
            }
        }
        let ctx = self.ctxs[c].as_ref().expect("a live context");
        let mut st = ctx.store.get().lock();
        let busy = match py {
            Some(py) => match waits(py, ctx, rec.now, *now, st.now(), &batch.events)? {
                Some(w) => w,
                None => return Ok(Step::Python),
            },
            None if ctx.busy => return Ok(Step::Gil),
            None => None,
        };
        let rules = Rules {
            slot: ctx.slot,
            block_size: ctx.block_size,
            seed: ctx.seed,
            max_blocks: ctx.max_blocks,
            pool_mode: ctx.pool_mode,
            reannounces: ctx.reannounces,
            kind0: ctx.kind0.as_deref(),
        };
        let work = &mut self.work;
        let applied = work.apply.apply(&rules, &mut st, busy, rec.now, &batch.events, &self.tiers, now);
        let tally = std::mem::take(&mut work.apply.tally);
        work.counters[HASH_CONFLICTS] += tally.hash_conflicts;
        work.counters[REMOVAL_UNKNOWN] += tally.removal_unknown;
        let Some(applied) = applied.map_err(store_err)? else {
            return Ok(Step::Python);
        };
        let store_now = st.now();
        drop(st);
        self.spare.recycle(batch);
        let ctx = self.ctxs[c].as_mut().expect("a live context");
        for (total, n) in ctx.applied.iter_mut().zip(applied.per_tier) {
            *total += n;
        }
        ctx.stored |= applied.stored;
        ctx.store_now = store_now;
        let rank = ctx.rank;
        if !ctx.touched {
            ctx.touched = true;
            self.touched.push(c);
        }
        let missing = self.check_seq(rec.key, rank, rec.seq, *now);
        if missing != 0 {
            self.gaps.push((i, applied.blocks, missing));
        }
        Ok(Step::Applied)
    }
    /// `Index.check_seq`; returns how many messages were skipped.
    fn check_seq(&mut self, instance: &[u8], rank: u32, seq: Option<u64>, now: f64) -> u64 {
        let inst = self.insts.get_mut(instance).expect("a context's instance");
        inst.last_ts = now;
        inst.touched = true;
        let Some(seq) = seq else { return 0 };
        let entry = inst.seqs.entry(rank).or_insert((None, false));
        let last = entry.0.replace(seq);
        entry.1 = true;
        let Some(last) = last else { return 0 };
        let next = u128::from(last) + 1;
        let seq = u128::from(seq);
        if seq == next {
            0
        } else if seq > next {
            let missing = (seq - next) as u64;
            self.work.counters[SEQ_GAPS] += 1;
            self.work.counters[SEQ_MISSING] += missing;
            missing
        } else {
            self.work.counters[SEQ_REGRESSIONS] += 1;
            0
        }
    }

    fn drop_ctx(&mut self, c: usize) -> Option<usize> {
        let ctx = self.ctxs[c].take()?;
        self.by_sig.remove(&ctx.sig);
        self.free.push(c);
        Some(ctx.id)
    }

    fn output(&mut self, py: Python<'_>, stop: usize, code: u8, rank: Option<u64>, now: f64) -> RunOut {
        let counters = COUNTER_NAMES
            .iter()
            .zip(std::mem::take(&mut self.work.counters))
            .filter(|(_, v)| *v != 0)
            .map(|(&k, v)| (k, v))
            .collect();
        let mut ctxs = Vec::with_capacity(self.touched.len());
        for c in std::mem::take(&mut self.touched) {
            if let Some(ctx) = self.ctxs[c].as_mut() {
                ctxs.push((ctx.id, std::mem::take(&mut ctx.applied), std::mem::take(&mut ctx.stored), ctx.store_now));
                ctx.touched = false;
            }
        }
        let mut insts = Vec::new();
        for inst in self.insts.values_mut().filter(|i| i.touched) {
            inst.touched = false;
            let seqs = inst
                .seqs
                .iter_mut()
                .filter(|(_, s)| s.1)
                .map(|(&rank, s)| {
                    s.1 = false;
                    (rank, s.0.unwrap_or_default())
                })
                .collect();
            insts.push((inst.name.clone_ref(py), inst.last_ts, seqs));
        }
        (stop, code, rank, now, counters, std::mem::take(&mut self.gaps), ctxs, insts)
    }
}

#[pymethods]
impl EngineLane {
    /// `full_kinds`: `cache_groups.FULL_KINDS`; `engine_tier`: `media.engine_tier`.
    #[new]
    fn new(full_kinds: Vec<String>, engine_tier: Py<PyAny>) -> Self {
        EngineLane {
            full_kinds,
            engine_tier,
            mediums: Vec::new(),
            by_sig: HashMap::new(),
            ctxs: Vec::new(),
            free: Vec::new(),
            insts: HashMap::new(),
            miss: None,
            sig: Vec::new(),
            window: MIN_WINDOW,
            spare: engine_wire::Spare::default(),
            tiers: Vec::new(),
            work: Work::default(),
            touched: Vec::new(),
            gaps: Vec::new(),
        }
    }

    /// Applies `records[start..end]` (`core.Incoming`s; `end`: all of
    /// them) until one it cannot, with `now` the index's clock. Returns
    /// (stop, code, the payload's dp rank at a `NEED_CONTEXT` stop, the
    /// clock, counters moved, kv-seq gaps as (record, blocks, missing), per
    /// context touched (id, blocks applied per tier, tiers stored to, its
    /// store's clock), per instance touched (name, last event time, (rank,
    /// last kv-seq) changed)).
    #[pyo3(signature = (records, start, now, end=None))]
    fn run(
        &mut self,
        py: Python<'_>,
        records: &Bound<'_, PyList>,
        start: usize,
        now: f64,
        end: Option<usize>,
    ) -> PyResult<RunOut> {
        let mut now = now;
        let mut sig = std::mem::take(&mut self.sig);
        let end = end.map_or(records.len(), |e| e.min(records.len()));
        let mut i = start;
        let result = loop {
            if i >= end {
                break (i, DONE, None);
            }
            let item = records.get_item(i)?;
            let Some(rec) = read_record(&item, &mut sig)? else { break (i, PYTHON, None) };
            match self.step(Some(py), i, &rec, &mut sig, &mut now)? {
                Step::Applied => i += 1,
                Step::NeedContext(rank) => break (i, NEED_CONTEXT, rank),
                Step::Python | Step::Gil => break (i, PYTHON, None),
            }
        };
        self.sig = sig;
        let (stop, code, rank) = result;
        Ok(self.output(py, stop, code, rank, now))
    }

    /// `run` with the GIL released while records apply: the records are
    /// read first, then decoded and applied with each store locked for one
    /// record at a time, so a query waits for one record, not the batch.
    /// It also stops (`GIL`) at a record that needs the GIL, which `run`
    /// then applies. Nothing may change the index's pending halves, or
    /// these contexts, until it returns.
    fn run_free(&mut self, py: Python<'_>, records: &Bound<'_, PyList>, start: usize, now: f64) -> PyResult<RunOut> {
        for ctx in self.ctxs.iter_mut().flatten() {
            ctx.busy = !ctx.pending.bind(py).is_empty();
        }
        let end = records.len().min(start.saturating_add(self.window));
        let items = (start..end).map(|i| records.get_item(i)).collect::<PyResult<Vec<_>>>()?;
        let mut sig = std::mem::take(&mut self.sig);
        let mut recs = Vec::with_capacity(items.len());
        let mut sigs = Vec::new();
        for item in &items {
            let Some(rec) = read_record(item, &mut sig)? else { break };
            sigs.extend_from_slice(&sig);
            recs.push((rec, sigs.len()));
        }
        let (read, unread) = (recs.len(), recs.len() < items.len());
        let mut now = now;
        let result = py.detach(|| -> PyResult<(usize, u8, Option<u64>)> {
            let mut from = 0;
            for (k, (rec, to)) in recs.iter().enumerate() {
                sig.clear();
                sig.extend_from_slice(&sigs[from..*to]);
                from = *to;
                let i = start + k;
                match self.step(None, i, rec, &mut sig, &mut now)? {
                    Step::Applied => {}
                    Step::NeedContext(rank) => return Ok((i, NEED_CONTEXT, rank)),
                    Step::Python => return Ok((i, PYTHON, None)),
                    Step::Gil => return Ok((i, GIL, None)),
                }
            }
            // Past the records read: the next is the Python path's, or
            // none is left in the window (the caller calls again).
            let code = if unread { PYTHON } else { DONE };
            Ok((start + read, code, None))
        });
        if let Ok((stop, _, _)) = &result {
            self.window = (2 * (stop - start + 1)).clamp(MIN_WINDOW, MAX_WINDOW);
        }
        self.sig = sig;
        let (stop, code, rank) = result?;
        Ok(self.output(py, stop, code, rank, now))
    }

    /// A context for the record `run` last stopped at with `NEED_CONTEXT`:
    /// its instance's `name`, the owner's `slot` in `store` for `rank`,
    /// and the facts the caller checked (see the module doc).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (id, name, store, pending, waiting, children, unresolved, max_pending_age, slot, block_size, seed, max_blocks, pool_mode, reannounces, kind0, rank, last_seq))]
    fn add_context(
        &mut self,
        id: usize,
        name: Py<PyString>,
        store: Py<BlockStore>,
        pending: Py<PyDict>,
        waiting: Py<PyDict>,
        children: Py<PyDict>,
        unresolved: Py<PyDict>,
        max_pending_age: f64,
        slot: usize,
        block_size: usize,
        seed: u64,
        max_blocks: usize,
        pool_mode: bool,
        reannounces: bool,
        kind0: Option<String>,
        rank: u32,
        last_seq: Option<u64>,
    ) -> PyResult<()> {
        let Some((sig, instance)) = self.miss.take() else {
            return Err(pyo3::exceptions::PyAssertionError::new_err("no record waits for a context"));
        };
        if block_size == 0 || kind0.as_ref().is_some_and(|k| !self.full_kinds.contains(k)) {
            return Err(pyo3::exceptions::PyValueError::new_err("not a context the lane can apply"));
        }
        let store_now = store.get().lock().now();
        let ctx = Ctx {
            id,
            sig: sig.clone(),
            store,
            pending,
            waiting,
            children,
            unresolved,
            max_pending_age,
            slot,
            block_size,
            seed,
            max_blocks,
            pool_mode,
            reannounces,
            kind0,
            rank,
            applied: [0; TIERS],
            stored: 0,
            touched: false,
            store_now,
            busy: true,
        };
        let c = match self.free.pop() {
            Some(c) => {
                self.ctxs[c] = Some(ctx);
                c
            }
            None => {
                self.ctxs.push(Some(ctx));
                self.ctxs.len() - 1
            }
        };
        self.by_sig.insert(sig, c);
        let inst = self.insts.entry(instance).or_insert_with(|| Inst {
            name,
            ctxs: Vec::new(),
            last_ts: 0.0,
            touched: false,
            seqs: HashMap::new(),
        });
        inst.ctxs.push(c);
        inst.seqs.entry(rank).or_insert((last_seq, false));
        Ok(())
    }

    /// Forgets an instance's contexts (its record went the Python way);
    /// returns their ids.
    fn forget(&mut self, instance: &[u8]) -> Vec<usize> {
        let Some(inst) = self.insts.remove(instance) else { return Vec::new() };
        inst.ctxs.into_iter().filter_map(|c| self.drop_ctx(c)).collect()
    }

    /// Forgets every context.
    fn reset(&mut self) {
        self.by_sig.clear();
        self.ctxs.clear();
        self.free.clear();
        self.insts.clear();
        self.miss = None;
    }

    fn __len__(&self) -> usize {
        self.by_sig.len()
    }
}
