//! Maps that grow a part at a time.
//!
//! A hash table grows by doubling, which rehashes every key at once: at
//! millions of blocks the catalog's doubling held one record's apply (and
//! the daemon's event loop) for longer than a query may wait. Past
//! `SPLIT_AT` keys a map is split into `SHARDS` tables by the top bits of an
//! independently seeded hash, so one doubling rehashes a sixty-fourth of
//! the keys; the total work and the memory are the same. Small maps (most
//! namespaces) stay one table and pay nothing.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;
use hashbrown::hash_map::Entry;
use hashbrown::HashMap;

const SHARD_BITS: u32 = 6;
pub const SHARDS: usize = 1 << SHARD_BITS;
/// Keys at which a map splits: small enough that one doubling is short.
pub const SPLIT_AT: usize = 1 << 16;

/// The shard of a key hashed to `h` (its top bits), once a map is split.
#[inline]
pub fn shard_of(h: u64) -> usize {
    (h >> (64 - SHARD_BITS)) as usize
}

/// Room for each table when `n` keys spread over a map's tables: all of
/// them in one, or a sixty-fourth and a quarter more (a random split is
/// not even) in each of `SHARDS`.
pub fn share(n: usize, split: bool) -> usize {
    if split {
        n / SHARDS + n / (4 * SHARDS)
    } else {
        n
    }
}

/// `HashMap<u64, V>`, split into shards once large (see the module doc).
pub struct ShardedMap<V> {
    shards: Vec<HashMap<u64, V>>,
    len: usize,
    /// Picks the shard; seeded apart from the shards' own hasher, whose top
    /// bits hashbrown uses for its control bytes.
    pick: RandomState,
}

impl<V> Default for ShardedMap<V> {
    fn default() -> Self {
        ShardedMap { shards: vec![HashMap::new()], len: 0, pick: RandomState::default() }
    }
}

impl<V> ShardedMap<V> {
    #[inline]
    fn shard(&self, key: u64) -> usize {
        if self.shards.len() == SHARDS {
            shard_of(self.pick.hash_one(key))
        } else {
            0
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, key: &u64) -> Option<&V> {
        self.shards[self.shard(*key)].get(key)
    }

    pub fn get_mut(&mut self, key: &u64) -> Option<&mut V> {
        let s = self.shard(*key);
        self.shards[s].get_mut(key)
    }

    pub fn contains_key(&self, key: &u64) -> bool {
        self.shards[self.shard(*key)].contains_key(key)
    }

    /// The value under `key`, `make()` inserted first when it is absent
    /// (one probe either way); whether it was inserted.
    pub fn get_or_insert_with(&mut self, key: u64, make: impl FnOnce() -> V) -> (&mut V, bool) {
        self.split_if(self.len + 1);
        let s = self.shard(key);
        match self.shards[s].entry(key) {
            Entry::Occupied(o) => (o.into_mut(), false),
            Entry::Vacant(v) => {
                self.len += 1;
                (v.insert(make()), true)
            }
        }
    }

    pub fn remove(&mut self, key: &u64) -> Option<V> {
        let s = self.shard(*key);
        let out = self.shards[s].remove(key);
        self.len -= usize::from(out.is_some());
        out
    }

    /// Room for `n` more keys without growing (spread evenly when split).
    pub fn reserve(&mut self, n: usize) {
        self.split_if(self.len + n);
        let room = share(n, self.shards.len() == SHARDS);
        for shard in &mut self.shards {
            shard.reserve(room);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &V)> + '_ {
        self.shards.iter().flatten()
    }

    /// One map becomes `SHARDS` when it is to hold `want` keys, past `SPLIT_AT`.
    fn split_if(&mut self, want: usize) {
        if self.shards.len() == SHARDS || want < SPLIT_AT {
            return;
        }
        let old = std::mem::take(&mut self.shards);
        let room = share(want, true);
        self.shards = (0..SHARDS).map(|_| HashMap::with_capacity(room)).collect();
        for (k, v) in old.into_iter().flatten() {
            let s = self.shard(k);
            self.shards[s].insert(k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{share, shard_of, ShardedMap, SHARDS, SPLIT_AT};

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
        let mut map: ShardedMap<u64> = ShardedMap::default();
        let n = SPLIT_AT as u64 + 500;
        for k in 0..n {
            let (v, inserted) = map.get_or_insert_with(k, || k * 2);
            assert!(inserted);
            assert_eq!(*v, k * 2);
        }
        assert_eq!(map.len(), n as usize);
        let (_, inserted) = map.get_or_insert_with(3, || 0);
        assert!(!inserted, "a present key is not inserted again");
        for k in 0..n {
            assert_eq!(map.get(&k), Some(&(k * 2)));
        }
        *map.get_mut(&5).unwrap() = 1;
        assert_eq!(map.get(&5), Some(&1));
        assert_eq!(map.remove(&5), Some(1));
        assert_eq!(map.remove(&5), None);
        assert!(!map.contains_key(&5));
        assert_eq!(map.len(), n as usize - 1);
        assert_eq!(map.iter().count(), n as usize - 1);
    }

    #[test]
    fn reserve_splits_ahead_of_the_inserts() {
        let mut map: ShardedMap<()> = ShardedMap::default();
        map.reserve(SPLIT_AT);
        map.get_or_insert_with(1, || ());
        assert!(map.contains_key(&1));
        assert_eq!(map.len(), 1);
    }
}
