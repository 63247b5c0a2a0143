//! One owner as the engine lane changes it.

use hashbrown::HashMap;

use super::catalog::Catalog;
use super::cut::Frozen;
use super::holders::{Holder, OwnerTier};
use super::{Error, Store, TIERS};
use crate::maps::{CountMap, SeqSet};

impl Store {
    /// The store's clock (`set_now`, `touch_expire`).
    pub fn now(&self) -> f64 {
        self.cat.now
    }

    /// The owner at `slot` as the engine lane changes it (`LaneOwner`).
    pub fn lane_owner(&mut self, slot: usize) -> Option<LaneOwner<'_>> {
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

/// What the engine lane (`kernel/py/src/lane.rs`) does to one owner: `place_owner` and
/// `remove_owner` split in two, so that a record applies whole or not at
/// all without a dry run that probes every hash before the apply probes it
/// again. The tier sets change first (`insert`, `remove`, each undone by
/// the other; nothing reads them in between), then, once the whole record
/// is known to apply, the catalog and the masks follow in the record's
/// order (`acquire`, `release`).
pub struct LaneOwner<'s> {
    cat: &'s mut Catalog,
    tiers: &'s mut [SeqSet; TIERS],
    dups: &'s mut HashMap<(u8, u64), u32>,
    /// The owner's 64-slot word of each tier's masks.
    masks: [&'s mut CountMap; TIERS],
    frozen: &'s mut Frozen,
    slot: usize,
}

impl LaneOwner<'_> {
    pub fn size(&self) -> usize {
        self.tiers.iter().map(SeqSet::len).sum()
    }

    /// Whether the tier did not hold `seq` (now it does).
    pub fn insert(&mut self, tier: usize, seq: u64) -> bool {
        self.frozen.keep_tier(self.slot, tier, &self.tiers[tier]);
        self.tiers[tier].insert(seq)
    }

    /// Whether the tier held `seq` (now it does not).
    pub fn remove(&mut self, tier: usize, seq: u64) -> bool {
        self.frozen.keep_tier(self.slot, tier, &self.tiers[tier]);
        self.tiers[tier].remove(&seq)
    }

    pub fn content(&self, seq: u64) -> Option<u64> {
        self.cat.ident(seq)
    }

    /// Asks for the cache lines of `seq` in the tier and the catalog: at
    /// hundreds of thousands of blocks each probe is likely a miss, and a
    /// record's hashes asked for together overlap them.
    #[inline]
    pub fn prefetch(&self, tier: usize, seq: u64) {
        self.tiers[tier].prefetch(seq);
        self.cat.map.prefetch(seq);
    }

    /// Asks for the cache line of content `ident` in the tier's masks.
    #[inline]
    pub fn prefetch_mask(&self, tier: usize, ident: u64) {
        self.masks[tier].prefetch(ident);
    }

    /// The content of `seq` when some tier or pool holds it (held content
    /// is never expired or evicted, unlike retired content).
    pub fn held_content(&self, seq: u64) -> Option<u64> {
        self.cat.map.get(&seq).filter(|b| b.refs > 0).map(|b| b.ident)
    }

    /// `NamespaceIndex.touch` then `expire`, as a store's namespace is
    /// fetched before each store event (`touch` moves the clock forward only).
    pub fn touch_expire(&mut self, now: f64) {
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
    pub fn acquire(&mut self, tier: usize, seq: u64, ident: u64) -> bool {
        let canon = self.cat.acquire(seq, ident);
        self.holder(tier).count(seq, canon);
        canon != ident
    }

    /// The catalog and masks of `seq`, removed from the tier.
    pub fn release(&mut self, tier: usize, seq: u64) -> Result<(), Error> {
        let ident = self.cat.release(seq)?;
        self.holder(tier).uncount(ident);
        Ok(())
    }
}
