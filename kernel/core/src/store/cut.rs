//! What a snapshot's cut keeps of the owner tiers and pools it froze.

use hashbrown::{HashMap, HashSet};

use crate::maps::SeqSet;

/// Owner tiers and pools frozen at an open cut (`freeze_owner`,
/// `freeze_pool`) whose hashes are still to be read, and the hashes of
/// those a change reached first, kept as they were: the cut costs a mark
/// a unit, and a copy only of what changes before it is read.
#[derive(Default)]
pub(crate) struct Frozen {
    pub(crate) tiers: HashSet<(usize, usize)>,
    pub(crate) pools: HashSet<i64>,
    pub(crate) kept_tiers: HashMap<(usize, usize), Vec<u64>>,
    pub(crate) kept_pools: HashMap<i64, Vec<u64>>,
}

impl Frozen {
    /// Before `held` (an owner's tier) changes or goes (inline: the lane
    /// calls it for every hash, and no cut is open nearly always).
    #[inline]
    pub(crate) fn keep_tier(&mut self, slot: usize, tier: usize, held: &SeqSet) {
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
    pub(crate) fn keep_pool(&mut self, pid: i64, held: &SeqSet) {
        if !self.pools.is_empty() && self.pools.remove(&pid) {
            self.kept_pools.insert(pid, held.iter().copied().collect());
        }
    }
}
