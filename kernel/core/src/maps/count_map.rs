//! `CountMap`: identity -> non-zero u64 (owner bits, or a holder count), the
//! maps the query walk probes.
//!
//! Open addressing with linear probing over one array of (key, value)
//! pairs (of any length: see `GROW_QUARTERS`), so that a probe reads one
//! cache line where a SwissTable reads its control bytes and then its
//! bucket, and so that the walk can prefetch a chunk of blocks' lines
//! before it reads any (see `store::GATHER`): at
//! millions of entries hashbrown's two dependent misses per probe were
//! most of a query. A value of 0 marks an empty slot (a key whose value
//! drops to 0 is removed), and deletion shifts the run back, so there are
//! no tombstones. Keys are hashed with foldhash's per-process random seed,
//! as the other maps are: they come from engines.
//!
//! A large map is split into `SHARDS` tables by the top bits of the hash
//! (`table::Tables`; the catalog, `sharded::ShardedMap`, is laid out the same way).

use super::table::{Slot, Tables};

/// (key, value): empty at value 0 (a key whose value drops to 0 goes).
impl Slot for (u64, u64) {
    const EMPTY: Self = (0, 0);
    fn key(self) -> u64 {
        self.0
    }
    fn used(self) -> bool {
        self.1 != 0
    }
}

/// identity -> non-zero u64 (see the module doc).
#[derive(Default)]
pub struct CountMap {
    slots: Tables<(u64, u64)>,
}

impl CountMap {
    pub fn is_empty(&self) -> bool {
        self.slots.len() == 0
    }

    #[inline]
    pub fn get(&self, key: u64) -> u64 {
        self.slots.get(key).map_or(0, |s| s.1)
    }

    pub fn contains(&self, key: u64) -> bool {
        self.get(key) != 0
    }

    /// Asks for `key`'s cache line ahead of a `get`.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        self.slots.prefetch(key);
    }

    /// Room for `n` more keys without growing (spread evenly when split).
    pub fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
    }

    /// Sets `value`'s bits under `key` (inserted if absent, `value` != 0);
    /// returns what was there before (0: absent).
    pub fn or(&mut self, key: u64, value: u64) -> u64 {
        self.update(key, |v| v | value)
    }

    /// Adds one to `key`'s count.
    pub fn increment(&mut self, key: u64) {
        self.update(key, |v| v + 1);
    }

    /// `f` of the value under `key` (0 when absent) becomes its value; the
    /// old value is returned. `f` must not return 0.
    fn update(&mut self, key: u64, f: impl FnOnce(u64) -> u64) -> u64 {
        let (slot, found) = self.slots.slot_for(key);
        let old = if found { slot.1 } else { 0 };
        *slot = (key, f(old));
        old
    }

    /// Clears `bits` under `key`; the key goes when no bit is left.
    pub fn clear_bits(&mut self, key: u64, bits: u64) {
        self.change(key, |v| v & !bits);
    }

    /// Takes one from `key`'s count; the key goes at zero.
    pub fn decrement(&mut self, key: u64) {
        self.change(key, |v| v - 1);
    }

    fn change(&mut self, key: u64, f: impl FnOnce(u64) -> u64) {
        self.slots.change(key, |slot| {
            slot.1 = f(slot.1);
            slot.1 == 0
        });
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::CountMap;
    use crate::maps::table::SPLIT_AT;

    /// The map against std's HashMap under `n` keys' worth of increments,
    /// bit sets, clears and decrements, with `n` past `SPLIT_AT` if asked.
    fn against_reference(n: u64) {
        let mut map = CountMap::default();
        let mut reference: HashMap<u64, u64> = HashMap::new();
        for k in 0..n {
            // Spread the keys so that runs collide and wrap around.
            let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            map.increment(key);
            *reference.entry(key).or_insert(0) += 1;
            if k % 3 == 0 {
                assert_eq!(map.or(key, 0b100), reference[&key]);
                *reference.get_mut(&key).unwrap() |= 0b100;
            }
        }
        for k in (0..n).step_by(2) {
            let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            map.clear_bits(key, 0b100);
            map.decrement(key);
            let v = reference[&key] & !0b100;
            if v <= 1 {
                reference.remove(&key);
            } else {
                reference.insert(key, v - 1);
            }
        }
        assert_eq!(map.is_empty(), reference.is_empty());
        assert_eq!(map.slots.len(), reference.len());
        let mut seen: Vec<(u64, u64)> = map.iter().collect();
        let mut want: Vec<(u64, u64)> = reference.iter().map(|(&k, &v)| (k, v)).collect();
        seen.sort_unstable();
        want.sort_unstable();
        assert_eq!(seen, want);
        for k in 0..n {
            let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            assert_eq!(map.get(key), reference.get(&key).copied().unwrap_or(0));
            assert_eq!(map.contains(key), reference.contains_key(&key));
        }
    }

    #[test]
    fn one_table_matches_a_hash_map() {
        against_reference(1_000);
    }

    #[test]
    fn split_tables_match_a_hash_map() {
        against_reference(SPLIT_AT as u64 + 1_000);
    }

    #[test]
    fn a_key_goes_when_its_value_reaches_zero() {
        let mut map = CountMap::default();
        map.increment(7);
        map.or(7, 0b10);
        map.clear_bits(7, 0b10);
        assert_eq!(map.get(7), 1);
        map.decrement(7);
        assert!(map.is_empty());
        assert!(!map.contains(7));
        // Changing an absent key is a no-op, not a panic.
        map.decrement(7);
        map.clear_bits(8, 1);
        assert!(map.is_empty());
    }

    #[test]
    fn deletion_keeps_every_run_reachable() {
        // Keys of one run: removing the first must not hide the later ones.
        let mut map = CountMap::default();
        let keys: Vec<u64> = (1..=64).collect();
        for &k in &keys {
            map.or(k, k);
        }
        for &k in keys.iter().step_by(3) {
            map.clear_bits(k, k);
        }
        for &k in &keys {
            let want = if (k - 1) % 3 == 0 { 0 } else { k };
            assert_eq!(map.get(k), want, "key {k}");
        }
    }

    #[test]
    fn reserve_then_fill_past_the_split() {
        let mut map = CountMap::default();
        map.reserve(SPLIT_AT + 10);
        for k in 0..(SPLIT_AT as u64 + 10) {
            map.increment(k);
        }
        assert_eq!(map.iter().count(), SPLIT_AT + 10);
        assert!(map.iter().all(|(_, v)| v == 1));
    }
}
