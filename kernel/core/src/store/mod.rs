//! A namespace's per-block state: `kvconductor/index/block_store.py`'s
//! `PyBlockStore`, call for call, in plain Rust. `kernel/py/src/store.rs`
//! (`BlockStore`) is its Python edge: it converts the arguments, takes the
//! lock, and turns an `Error` into the exception `PyBlockStore` raises
//! (tests/test_block_store.py drives both and compares them). See README.md.
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

mod catalog;
mod cut;
mod holders;
mod lane;
mod walk;

use hashbrown::HashMap;

use crate::maps::{CountMap, SeqSet};
use catalog::Catalog;
use cut::Frozen;
use holders::{clear, load, place, unplace, OwnerTier, PoolBlocks};

pub use holders::Placed;
pub use lane::LaneOwner;
pub use walk::{Given, Matched, Prompt, Source, Tokens, GATHER};

pub const DEVICE: usize = 0;
pub const HOST: usize = 1;
pub const DISK: usize = 2;
pub const TIERS: usize = 3;
/// Owner slots are bits of the masks; a bound keeps a wrong slot from
/// allocating words for millions of them.
pub const MAX_SLOTS: usize = 1 << 20;

/// What a call refuses, each the exception `PyBlockStore` raises for it
/// (the edge makes it: `KeyError(key)`, `IndexError(message)`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// `KeyError(seq)`: a release of a block nobody holds.
    NotHeld(u64),
    /// `KeyError(seq)`: a cut asked the identity of a block it never saw.
    Unknown(u64),
    /// `KeyError(slot)`.
    NoOwner(usize),
    /// `KeyError(pid)`.
    NoPool(i64),
    /// `IndexError`.
    TierOutOfRange,
    /// `IndexError`.
    FewerIdentities,
    /// `ValueError`.
    SlotOutOfRange,
    /// `ValueError`.
    BadBytes,
    /// `ValueError`.
    RetiredLengths,
    /// `ValueError`.
    BlockSize,
    /// `ValueError`: a tier's or pool's hashes and identities differ in count.
    CountsDiffer(&'static str),
    /// `AssertionError`: a load into a tier or pool that is not empty.
    NotEmpty(&'static str),
    /// `AssertionError`.
    NoCutOpen,
    /// `AssertionError`.
    EndCutWithoutBegin,
    /// `AssertionError`.
    TierNotFrozen,
    /// `AssertionError`.
    PoolNotFrozen,
}

impl std::fmt::Display for Error {
    /// The exception's message (a `KeyError`'s is its key).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::NotHeld(seq) | Error::Unknown(seq) => write!(f, "{seq}"),
            Error::NoOwner(slot) => write!(f, "{slot}"),
            Error::NoPool(pid) => write!(f, "{pid}"),
            Error::TierOutOfRange => f.write_str("tier index out of range"),
            Error::FewerIdentities => f.write_str("fewer identities than hashes"),
            Error::SlotOutOfRange => f.write_str("owner slot out of range"),
            Error::BadBytes => f.write_str("bytes length not a multiple of item size"),
            Error::RetiredLengths => f.write_str("retired arrays of different lengths"),
            Error::BlockSize => f.write_str("block_size must be a positive integer"),
            Error::CountsDiffer(what) => write!(f, "a {what}'s hashes and identities differ in count"),
            Error::NotEmpty(what) => write!(f, "load is for an empty {what}"),
            Error::NoCutOpen => f.write_str("no cut is open"),
            Error::EndCutWithoutBegin => f.write_str("end_cut without begin_cut"),
            Error::TierNotFrozen => f.write_str("owner tier not frozen at this cut"),
            Error::PoolNotFrozen => f.write_str("pool not frozen at this cut"),
        }
    }
}

impl std::error::Error for Error {}

/// Little-endian u64s.
pub fn unpack(data: &[u8]) -> Result<Vec<u64>, Error> {
    if !data.len().is_multiple_of(8) {
        return Err(Error::BadBytes);
    }
    Ok(data.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect())
}

fn tier_ix(tier: usize) -> Result<usize, Error> {
    if tier < TIERS {
        Ok(tier)
    } else {
        Err(Error::TierOutOfRange)
    }
}

struct Owner {
    tiers: [SeqSet; TIERS],
    dups: HashMap<(u8, u64), u32>,
}

struct Pool {
    tier: usize,
    blocks: SeqSet,
}

/// A tier's or pool's hashes and their identities, in the set's order.
pub type Exported = (Vec<u64>, Vec<u64>);

/// (seq, identity) of every hash a tier or pool holds.
pub type Held = Vec<(u64, u64)>;
/// An owner's slot, its tiers' `Held`, its (tier, identity) -> extra holders.
pub type OwnerDump = (usize, Vec<Held>, Vec<((u8, u64), u32)>);
/// A pool's id, tier and `Held`.
pub type PoolDump = (i64, usize, Held);

/// Every map as `PyBlockStore.dump` gives it, in plain Rust.
pub struct Dump {
    /// (seq, identity) of every catalog entry.
    pub content: Vec<(u64, u64)>,
    /// (seq, holders) of the held ones.
    pub refs: Vec<(u64, u32)>,
    /// (seq, retired at), oldest first.
    pub retired: Vec<(u64, f64)>,
    /// Per tier: identity -> its owner bits, as 64-bit words.
    pub masks: Vec<HashMap<u64, Vec<u64>>>,
    /// Per tier: identity -> holding pools.
    pub pool_counts: Vec<Vec<(u64, u64)>>,
    /// slot -> (per tier (seq, identity), (tier, identity) -> extra holders).
    pub owners: Vec<OwnerDump>,
    /// pid -> (tier, (seq, identity)).
    pub pools: Vec<PoolDump>,
}

/// A namespace's blocks (see the module doc).
pub struct Store {
    cat: Catalog,
    /// Per tier, per 64-slot word: identity -> the word's owner bits.
    masks: [Vec<CountMap>; TIERS],
    pool_counts: [CountMap; TIERS],
    owners: HashMap<usize, Owner>,
    pools: HashMap<i64, Pool>,
    frozen: Frozen,
}

impl Store {
    pub fn new(max_retired: usize, max_age_s: f64) -> Self {
        Store {
            cat: Catalog::new(max_retired, max_age_s),
            masks: [Vec::new(), Vec::new(), Vec::new()],
            pool_counts: Default::default(),
            owners: HashMap::new(),
            pools: HashMap::new(),
            frozen: Frozen::default(),
        }
    }

    fn owner(&self, slot: usize) -> Result<&Owner, Error> {
        self.owners.get(&slot).ok_or(Error::NoOwner(slot))
    }

    fn pool(&self, pid: i64) -> Result<&Pool, Error> {
        self.pools.get(&pid).ok_or(Error::NoPool(pid))
    }

    fn cut_open(&self) -> Result<(), Error> {
        if self.cat.cuts == 0 {
            return Err(Error::NoCutOpen);
        }
        Ok(())
    }

    /// The catalog and an owner's tier as a `Holder`.
    fn owner_tier(&mut self, slot: usize, tier: usize) -> Result<(&mut Catalog, OwnerTier<'_>), Error> {
        let tier = tier_ix(tier)?;
        let owner = self.owners.get_mut(&slot).ok_or(Error::NoOwner(slot))?;
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

    fn pool_blocks<'s>(
        &'s mut self,
        pid: i64,
        placed_out: Option<&'s mut Vec<u64>>,
    ) -> Result<(&'s mut Catalog, PoolBlocks<'s>), Error> {
        let pool = self.pools.get_mut(&pid).ok_or(Error::NoPool(pid))?;
        self.frozen.keep_pool(pid, &pool.blocks);
        let h = PoolBlocks { set: &mut pool.blocks, counts: &mut self.pool_counts[pool.tier], placed_out };
        Ok((&mut self.cat, h))
    }

    fn export(&self, held: &SeqSet) -> Exported {
        (held.iter().copied().collect(), held.iter().map(|&s| self.cat.held_ident(s)).collect())
    }

    // ------------------------------------------------------------- catalog

    pub fn set_now(&mut self, now: f64) {
        self.cat.now = now;
    }

    pub fn ident(&self, seq: u64) -> Option<u64> {
        self.cat.ident(seq)
    }

    /// The identities of `seqs` up to the first the catalog does not know.
    pub fn identities_of(&self, seqs: &[u64]) -> Vec<u64> {
        seqs.iter().map_while(|&s| self.cat.ident(s)).collect()
    }

    pub fn acquire(&mut self, seq: u64, ident: u64) -> u64 {
        self.cat.acquire(seq, ident)
    }

    pub fn release(&mut self, seq: u64) -> Result<(), Error> {
        self.cat.release(seq).map(drop)
    }

    pub fn remember(&mut self, seq: u64, ident: u64) {
        let now = self.cat.now;
        self.cat.retire_new(seq, ident, now);
    }

    pub fn pool_holds(&self, ident: u64) -> bool {
        self.pool_counts[HOST].contains(ident) || self.pool_counts[DISK].contains(ident)
    }

    pub fn content_len(&self) -> usize {
        self.cat.map.len()
    }

    // ------------------------------------------------------------- retired

    pub fn expire(&mut self, now: f64) {
        self.cat.expire(now);
    }

    pub fn retired_len(&self) -> usize {
        self.cat.live
    }

    pub fn retired_version(&self) -> u64 {
        self.cat.version
    }

    /// (seq, identity, retired at) of the live retired entries, oldest first.
    pub fn export_retired(&self) -> Vec<(u64, u64, f64)> {
        self.cat.retired().collect()
    }

    pub fn load_retired(&mut self, seqs: &[u8], idents: &[u8], ts: &[u8]) -> Result<(), Error> {
        let (seqs, idents, ts) = (unpack(seqs)?, unpack(idents)?, unpack(ts)?);
        if idents.len() != seqs.len() || ts.len() != seqs.len() {
            return Err(Error::RetiredLengths);
        }
        for ((seq, ident), at) in seqs.into_iter().zip(idents).zip(ts) {
            self.cat.retire_new(seq, ident, f64::from_bits(at));
        }
        Ok(())
    }

    pub fn clear_retired(&mut self) {
        self.cat.clear_retired();
    }

    pub fn retired_limit(&self) -> usize {
        self.cat.max_entries
    }

    pub fn set_retired_limit(&mut self, limit: usize) {
        self.cat.max_entries = limit;
    }

    // ----------------------------------------------------------------- cuts

    pub fn begin_cut(&mut self) {
        let cat = &mut self.cat;
        cat.cuts += 1;
        cat.forgotten.get_or_insert_with(HashMap::new);
    }

    pub fn end_cut(&mut self) -> Result<(), Error> {
        let cat = &mut self.cat;
        if cat.cuts == 0 {
            return Err(Error::EndCutWithoutBegin);
        }
        cat.cuts -= 1;
        if cat.cuts == 0 {
            cat.forgotten = None;
            self.frozen = Frozen::default();
        }
        Ok(())
    }

    pub fn freeze_owner(&mut self, slot: usize) -> Result<(), Error> {
        self.cut_open()?;
        self.owner(slot)?;
        for tier in [DEVICE, HOST, DISK] {
            self.frozen.kept_tiers.remove(&(slot, tier));
            self.frozen.tiers.insert((slot, tier));
        }
        Ok(())
    }

    pub fn cut_owner_seqs(&mut self, slot: usize, tier: usize) -> Result<Vec<u64>, Error> {
        let tier = tier_ix(tier)?;
        if let Some(kept) = self.frozen.kept_tiers.remove(&(slot, tier)) {
            return Ok(kept);
        }
        if !self.frozen.tiers.remove(&(slot, tier)) {
            return Err(Error::TierNotFrozen);
        }
        Ok(self.owner(slot)?.tiers[tier].iter().copied().collect())
    }

    pub fn freeze_pool(&mut self, pid: i64) -> Result<(), Error> {
        self.cut_open()?;
        self.pool(pid)?;
        self.frozen.kept_pools.remove(&pid);
        self.frozen.pools.insert(pid);
        Ok(())
    }

    pub fn cut_pool_seqs(&mut self, pid: i64) -> Result<Vec<u64>, Error> {
        if let Some(kept) = self.frozen.kept_pools.remove(&pid) {
            return Ok(kept);
        }
        if !self.frozen.pools.remove(&pid) {
            return Err(Error::PoolNotFrozen);
        }
        Ok(self.pool(pid)?.blocks.iter().copied().collect())
    }

    pub fn cut_identities(&self, seqs: &[u8]) -> Result<Vec<u64>, Error> {
        let cat = &self.cat;
        let Some(kept) = &cat.forgotten else {
            return Err(Error::NoCutOpen);
        };
        let seqs = unpack(seqs)?;
        let mut idents = Vec::with_capacity(seqs.len());
        for seq in seqs {
            match kept.get(&seq).copied().or_else(|| cat.ident(seq)) {
                Some(ident) => idents.push(ident),
                None => return Err(Error::Unknown(seq)),
            }
        }
        Ok(idents)
    }

    // -------------------------------------------------------------- owners

    pub fn add_owner(&mut self, slot: usize) -> Result<(), Error> {
        if slot >= MAX_SLOTS {
            return Err(Error::SlotOutOfRange);
        }
        for m in &mut self.masks {
            if m.len() <= slot >> 6 {
                m.resize_with((slot >> 6) + 1, CountMap::default);
            }
        }
        let owner = Owner { tiers: Default::default(), dups: HashMap::new() };
        self.owners.insert(slot, owner);
        Ok(())
    }

    pub fn drop_owner(&mut self, slot: usize) -> Result<(), Error> {
        let owner = self.owners.remove(&slot).ok_or(Error::NoOwner(slot))?;
        for (tier, held) in owner.tiers.iter().enumerate() {
            self.frozen.keep_tier(slot, tier, held);
        }
        Ok(())
    }

    pub fn owner_size(&self, slot: usize) -> Result<usize, Error> {
        Ok(self.owner(slot)?.tiers.iter().map(SeqSet::len).sum())
    }

    /// The hashes an owner's tier holds (the owner checked first, then the
    /// tier).
    pub fn owner_tier_set(&self, slot: usize, tier: usize) -> Result<&SeqSet, Error> {
        let owner = self.owner(slot)?;
        Ok(&owner.tiers[tier_ix(tier)?])
    }

    pub fn tier_len(&self, slot: usize, tier: usize) -> Result<usize, Error> {
        Ok(self.owner_tier_set(slot, tier)?.len())
    }

    pub fn place_owner(
        &mut self,
        slot: usize,
        tier: usize,
        seqs: &[u64],
        idents: Option<&[u64]>,
        room: i64,
    ) -> Result<Placed, Error> {
        let (cat, mut h) = self.owner_tier(slot, tier)?;
        place(cat, &mut h, seqs, idents, room)
    }

    /// The hashes of `seqs` the tier did not hold.
    pub fn remove_owner(&mut self, slot: usize, tier: usize, seqs: &[u64]) -> Result<Vec<u64>, Error> {
        let (cat, mut h) = self.owner_tier(slot, tier)?;
        let mut missing = Vec::new();
        for &seq in seqs {
            if !unplace(cat, &mut h, seq)? {
                missing.push(seq);
            }
        }
        Ok(missing)
    }

    pub fn clear_owner(&mut self, slot: usize) -> Result<usize, Error> {
        let mut removed = 0;
        for tier in [DEVICE, HOST, DISK] {
            let (cat, mut h) = self.owner_tier(slot, tier)?;
            removed += clear(cat, &mut h)?;
        }
        Ok(removed)
    }

    pub fn export_owner(&self, slot: usize, tier: usize) -> Result<Exported, Error> {
        Ok(self.export(self.owner_tier_set(slot, tier)?))
    }

    pub fn load_owner(&mut self, slot: usize, tier: usize, seqs: &[u8], idents: &[u8]) -> Result<(), Error> {
        let (cat, mut h) = self.owner_tier(slot, tier)?;
        let empty = h.set.is_empty();
        load(cat, &mut h, empty, seqs, idents, "tier")
    }

    // --------------------------------------------------------------- pools

    pub fn add_pool(&mut self, pid: i64, tier: usize) -> Result<(), Error> {
        let tier = tier_ix(tier)?;
        self.pools.insert(pid, Pool { tier, blocks: SeqSet::default() });
        Ok(())
    }

    pub fn drop_pool(&mut self, pid: i64) -> Result<(), Error> {
        let pool = self.pools.remove(&pid).ok_or(Error::NoPool(pid))?;
        self.frozen.keep_pool(pid, &pool.blocks);
        Ok(())
    }

    pub fn pool_len(&self, pid: i64) -> Result<usize, Error> {
        Ok(self.pool(pid)?.blocks.len())
    }

    /// `placed_out` gets the hashes newly held, in order (also those placed
    /// before an error).
    pub fn place_pool(
        &mut self,
        pid: i64,
        seqs: &[u64],
        idents: Option<&[u64]>,
        room: i64,
        placed_out: Option<&mut Vec<u64>>,
    ) -> Result<Placed, Error> {
        let (cat, mut h) = self.pool_blocks(pid, placed_out)?;
        place(cat, &mut h, seqs, idents, room)
    }

    pub fn remove_pool(&mut self, pid: i64, seq: u64) -> Result<bool, Error> {
        let (cat, mut h) = self.pool_blocks(pid, None)?;
        unplace(cat, &mut h, seq)
    }

    pub fn clear_pool(&mut self, pid: i64) -> Result<usize, Error> {
        let (cat, mut h) = self.pool_blocks(pid, None)?;
        clear(cat, &mut h)
    }

    pub fn export_pool(&self, pid: i64) -> Result<Exported, Error> {
        Ok(self.export(&self.pool(pid)?.blocks))
    }

    pub fn load_pool(&mut self, pid: i64, seqs: &[u8], idents: &[u8]) -> Result<(), Error> {
        let (cat, mut h) = self.pool_blocks(pid, None)?;
        let empty = h.set.is_empty();
        load(cat, &mut h, empty, seqs, idents, "pool")
    }

    // --------------------------------------------------------------- tests

    /// Every map, for `dump`.
    pub fn dump(&self) -> Dump {
        let cat = &self.cat;
        let content = cat.map.iter().map(|(&seq, b)| (seq, b.ident)).collect();
        let refs = cat.map.iter().filter(|(_, b)| b.refs > 0).map(|(&seq, b)| (seq, b.refs)).collect();
        let retired = cat.retired().map(|(s, _, ts)| (s, ts)).collect();
        let masks = self
            .masks
            .iter()
            .map(|tier| {
                let mut joined: HashMap<u64, Vec<u64>> = HashMap::new();
                for (w, word) in tier.iter().enumerate() {
                    for (ident, bits) in word.iter() {
                        joined.entry(ident).or_insert_with(|| vec![0; tier.len()])[w] = bits;
                    }
                }
                joined
            })
            .collect();
        let pool_counts = self.pool_counts.iter().map(|counts| counts.iter().collect()).collect();
        let held = |set: &SeqSet| -> Held { set.iter().map(|&seq| (seq, cat.held_ident(seq))).collect() };
        let owners = self
            .owners
            .iter()
            .map(|(&slot, o)| {
                (slot, o.tiers.iter().map(held).collect(), o.dups.iter().map(|(&k, &v)| (k, v)).collect())
            })
            .collect();
        let pools = self.pools.iter().map(|(&pid, p)| (pid, p.tier, held(&p.blocks))).collect();
        Dump { content, refs, retired, masks, pool_counts, owners, pools }
    }
}
