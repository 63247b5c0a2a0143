//! Maps that grow a part at a time.
//!
//! A hash table grows by rehashing every key at once: at millions of
//! blocks the catalog's doubling held one record's apply (and
//! the daemon's event loop) for longer than a query may wait. Past
//! `SPLIT_AT` keys a map is split into `SHARDS` tables by the top bits of its
//! hash, so one growth rehashes a sixty-fourth of the keys; the total work
//! and the memory are the same. Small maps (most
//! namespaces) stay one table and pay nothing.

use super::table::{Slot, Tables};

/// A value with one bit pattern a map's empty slots hold (never stored).
pub trait Vacant: Copy {
    const VACANT: Self;
    fn is_vacant(&self) -> bool;
}

impl<V: Vacant> Slot for (u64, V) {
    const EMPTY: Self = (0, V::VACANT);
    fn key(self) -> u64 {
        self.0
    }
    fn used(self) -> bool {
        !self.1.is_vacant()
    }
}

/// u64 -> `V`, split into shards once large (see the module doc), over
/// `table`'s linear-probing tables: 8 bytes a key beside its value and
/// a load of 60-75%, where a SwissTable's doubling left it at 44-87% with
/// a control byte more.
pub struct ShardedMap<V> {
    slots: Tables<(u64, V)>,
}

impl<V> Default for ShardedMap<V> {
    fn default() -> Self {
        ShardedMap { slots: Tables::default() }
    }
}

impl<V: Vacant> ShardedMap<V> {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn get(&self, key: &u64) -> Option<&V> {
        self.slots.get(*key).map(|s| &s.1)
    }

    pub fn get_mut(&mut self, key: &u64) -> Option<&mut V> {
        self.slots.get_mut(*key).map(|s| &mut s.1)
    }

    pub fn contains_key(&self, key: &u64) -> bool {
        self.slots.get(*key).is_some()
    }

    /// The value under `key`, `make()` inserted first when it is absent
    /// (one probe either way); whether it was inserted.
    pub fn get_or_insert_with(&mut self, key: u64, make: impl FnOnce() -> V) -> (&mut V, bool) {
        let (slot, found) = self.slots.slot_for(key);
        if !found {
            let v = make();
            debug_assert!(!v.is_vacant());
            *slot = (key, v);
        }
        (&mut slot.1, !found)
    }

    /// Asks for `key`'s cache line ahead of a probe.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        self.slots.prefetch(key);
    }

    pub fn remove(&mut self, key: &u64) -> Option<V> {
        self.slots.remove(*key).map(|s| s.1)
    }

    /// Room for `n` more keys without growing (spread evenly when split).
    pub fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &V)> + '_ {
        self.slots.iter().map(|s| (&s.0, &s.1))
    }
}

#[cfg(test)]
mod tests {
    use super::{ShardedMap, Vacant};
    use crate::maps::table::{shard_of, share, SHARDS, SPLIT_AT};

    /// Any u64 but `u64::MAX`.
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct V(u64);

    impl Vacant for V {
        const VACANT: Self = V(u64::MAX);
        fn is_vacant(&self) -> bool {
            self.0 == u64::MAX
        }
    }

    #[test]
    fn shard_of_reads_the_top_bits() {
        assert_eq!(shard_of(0), 0);
        assert_eq!(shard_of(u64::MAX), SHARDS - 1);
        assert_eq!(shard_of(1 << 63), SHARDS / 2);
    }

    #[test]
    fn share_leaves_room_for_an_uneven_split() {
        assert_eq!(share(1_000, false), 1_000);
        let each = share(SPLIT_AT * 4, true);
        assert!(each * SHARDS > SPLIT_AT * 4);
    }

    #[test]
    fn keeps_every_key_across_the_split() {
        let mut map: ShardedMap<V> = ShardedMap::default();
        let n = SPLIT_AT as u64 + 500;
        for k in 0..n {
            let (v, inserted) = map.get_or_insert_with(k, || V(k * 2));
            assert!(inserted);
            assert_eq!(*v, V(k * 2));
        }
        assert_eq!(map.len(), n as usize);
        let (_, inserted) = map.get_or_insert_with(3, || V(0));
        assert!(!inserted, "a present key is not inserted again");
        for k in 0..n {
            assert_eq!(map.get(&k), Some(&V(k * 2)));
        }
        *map.get_mut(&5).unwrap() = V(1);
        assert_eq!(map.get(&5), Some(&V(1)));
        assert_eq!(map.remove(&5), Some(V(1)));
        assert_eq!(map.remove(&5), None);
        assert!(!map.contains_key(&5));
        assert_eq!(map.len(), n as usize - 1);
        assert_eq!(map.iter().count(), n as usize - 1);
        // Key 0 is a key like any other.
        assert!(map.contains_key(&0));
        assert_eq!(map.remove(&0), Some(V(0)));
    }

    #[test]
    fn reserve_splits_ahead_of_the_inserts() {
        let mut map: ShardedMap<V> = ShardedMap::default();
        map.reserve(SPLIT_AT);
        map.get_or_insert_with(1, || V(7));
        assert!(map.contains_key(&1));
        assert_eq!(map.len(), 1);
    }
}
