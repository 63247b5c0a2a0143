//! `SeqSet`: the sequence hashes an owner tier or a pool store holds.
//!
//! The set a (block, owner) entry costs most of beside its mask: hashbrown's
//! 9 bytes a slot at 44-87% load (20 bytes a hash just after a doubling)
//! become 8 bytes at 60-75% (`table::Table`'s linear probing and
//! gentle growth). Key 0 is a real hash: it is kept beside the table, whose
//! empty slots are 0. Keys are hashed with foldhash's per-process random
//! seed, as the other maps are: they come from engines.
//!
//! The API is the part of `HashSet<u64>` the store uses.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

use super::table::{Slot, Table};

/// A bare key: empty at 0 (a set keeps key 0 beside its table).
impl Slot for u64 {
    const EMPTY: Self = 0;
    fn key(self) -> u64 {
        self
    }
    fn used(self) -> bool {
        self != 0
    }
}

#[derive(Default)]
pub struct SeqSet {
    table: Table<u64>,
    zero: bool,
    hasher: RandomState,
}

impl SeqSet {
    pub fn len(&self) -> usize {
        self.table.len + usize::from(self.zero)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, key: &u64) -> bool {
        let key = *key;
        if key == 0 {
            return self.zero;
        }
        self.table.len != 0 && self.table.find(key, self.hasher.hash_one(key)).1
    }

    /// Asks for `key`'s cache line ahead of an insert, removal or lookup.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        self.table.prefetch(self.hasher.hash_one(key));
    }

    /// Whether `key` was not there.
    pub fn insert(&mut self, key: u64) -> bool {
        if key == 0 {
            return !std::mem::replace(&mut self.zero, true);
        }
        self.table.reserve(1, &self.hasher);
        let (i, found) = self.table.find(key, self.hasher.hash_one(key));
        if !found {
            self.table.slots[i] = key;
            self.table.len += 1;
        }
        !found
    }

    /// Whether `key` was there.
    pub fn remove(&mut self, key: &u64) -> bool {
        let key = *key;
        if key == 0 {
            return std::mem::replace(&mut self.zero, false);
        }
        if self.table.len == 0 {
            return false;
        }
        let (i, found) = self.table.find(key, self.hasher.hash_one(key));
        if found {
            self.table.remove_at(i, &self.hasher);
        }
        found
    }

    /// Room for `n` more keys without growing.
    pub fn reserve(&mut self, n: usize) {
        self.table.reserve(n, &self.hasher);
    }

    /// The keys in no particular order (of known length: `pack` sizes its
    /// buffer by it).
    pub fn iter(&self) -> Iter<'_> {
        let zero = self.zero.then_some(&0u64);
        Iter { keys: Box::new(zero.into_iter().chain(self.table.slots.iter().filter(|&&k| k != 0))), left: self.len() }
    }
}

pub struct Iter<'a> {
    keys: Box<dyn Iterator<Item = &'a u64> + 'a>,
    left: usize,
}

impl<'a> Iterator for Iter<'a> {
    type Item = &'a u64;

    fn next(&mut self) -> Option<&'a u64> {
        let k = self.keys.next()?;
        self.left -= 1;
        Some(k)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl<'a> IntoIterator for &'a SeqSet {
    type Item = &'a u64;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::SeqSet;

    #[test]
    fn matches_a_hash_set() {
        let mut set = SeqSet::default();
        let mut reference: HashSet<u64> = HashSet::new();
        // Key 0 and u64::MAX among keys spread so that runs collide and wrap.
        let keys: Vec<u64> = (0..5_000u64).map(|k| k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).chain([u64::MAX]).collect();
        for &k in &keys {
            assert_eq!(set.insert(k), reference.insert(k));
            assert_eq!(set.insert(k), reference.insert(k));
        }
        for &k in keys.iter().step_by(3) {
            assert_eq!(set.remove(&k), reference.remove(&k));
            assert_eq!(set.remove(&k), reference.remove(&k));
        }
        assert_eq!(set.len(), reference.len());
        for &k in &keys {
            assert_eq!(set.contains(&k), reference.contains(&k), "key {k}");
        }
        let mut seen: Vec<u64> = set.iter().copied().collect();
        let mut want: Vec<u64> = reference.into_iter().collect();
        seen.sort_unstable();
        want.sort_unstable();
        assert_eq!(seen, want);
        for k in seen {
            assert!(set.remove(&k));
        }
        assert!(set.is_empty());
        assert!(!set.contains(&0));
    }

    #[test]
    fn load_stays_above_three_fifths_after_growth() {
        let mut set = SeqSet::default();
        for k in 1..=100_000u64 {
            set.insert(k);
            let cap = set.table.slots.len();
            assert!(set.table.len * 8 <= cap * 6, "over the load bound");
        }
        assert!(set.table.len * 5 >= set.table.slots.len() * 3 - 40);
    }
}
