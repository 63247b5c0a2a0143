//! `CountMap`: identity -> non-zero u64 (owner bits, or a holder count), the
//! maps the query walk probes.
//!
//! Open addressing with linear probing over one array of (key, value)
//! pairs, so that a probe reads one cache line where a SwissTable reads its
//! control bytes and then its bucket, and so that the walk can prefetch a
//! chunk of blocks' lines before it reads any (see `store::GATHER`): at
//! millions of entries hashbrown's two dependent misses per probe were
//! most of a query. A value of 0 marks an empty slot (a key whose value
//! drops to 0 is removed), and deletion shifts the run back, so there are
//! no tombstones. Keys are hashed with foldhash's per-process random seed,
//! as the other maps are: they come from engines.
//!
//! A large map is split into `SHARDS` tables by the top bits of the hash
//! (the low bits place a key within its table), so that growing doubles one
//! table, not all of them: at a million keys one doubling of all of them
//! stopped the event loop for a noticeable pause (see `sharded`).

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

use crate::sharded::{share, shard_of, SHARDS, SPLIT_AT};

/// At most this share of slots in use (in eighths): a miss scans on to an
/// empty slot, and longer runs make misses slower.
const MAX_LOAD_EIGHTHS: usize = 6;

/// One table: a power-of-two array of (key, value), `len` in use.
#[derive(Default)]
struct Table {
    slots: Vec<(u64, u64)>,
    len: usize,
}

impl Table {
    /// Where `key` (hashed to `h`) is, or the empty slot that ends its run.
    #[inline]
    fn find(&self, key: u64, h: u64) -> (usize, bool) {
        let mask = self.slots.len() - 1;
        let mut i = (h as usize) & mask;
        loop {
            let (k, v) = self.slots[i];
            if v == 0 {
                return (i, false);
            }
            if k == key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// Room for `n` more keys without growing.
    fn reserve(&mut self, n: usize, hasher: &RandomState) {
        let want = self.len + n;
        if want * 8 > self.slots.len() * MAX_LOAD_EIGHTHS {
            let capacity = (want * 8 / MAX_LOAD_EIGHTHS + 1).next_power_of_two().max(8);
            let old = std::mem::replace(&mut self.slots, vec![(0, 0); capacity]);
            for (k, v) in old {
                if v != 0 {
                    let (i, _) = self.find(k, hasher.hash_one(k));
                    self.slots[i] = (k, v);
                }
            }
        }
    }

    /// Backward-shift deletion: every later key of the run that may move
    /// closer to its home fills the hole, so runs stay unbroken.
    fn remove_at(&mut self, mut hole: usize, hasher: &RandomState) {
        let mask = self.slots.len() - 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let (k, v) = self.slots[i];
            if v == 0 {
                break;
            }
            let home = (hasher.hash_one(k) as usize) & mask;
            // `k` may move to the hole if its home is not in (hole, i].
            if (i.wrapping_sub(home) & mask) >= (i.wrapping_sub(hole) & mask) {
                self.slots[hole] = (k, v);
                hole = i;
            }
        }
        self.slots[hole] = (0, 0);
        self.len -= 1;
        if self.len == 0 {
            self.slots = Vec::new();
        }
    }
}

#[derive(Default)]
pub struct CountMap {
    /// One table, or `SHARDS` once the map outgrew `SPLIT_AT` keys.
    tables: Vec<Table>,
    len: usize,
    hasher: RandomState,
}

impl CountMap {
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `key`'s hash and its table.
    #[inline]
    fn locate(&self, key: u64) -> (u64, usize) {
        let h = self.hasher.hash_one(key);
        let t = if self.tables.len() == SHARDS { shard_of(h) } else { 0 };
        (h, t)
    }

    #[inline]
    pub fn get(&self, key: u64) -> u64 {
        if self.len == 0 {
            return 0;
        }
        let (h, t) = self.locate(key);
        let table = &self.tables[t];
        if table.len == 0 {
            return 0;
        }
        match table.find(key, h) {
            (i, true) => table.slots[i].1,
            _ => 0,
        }
    }

    pub fn contains(&self, key: u64) -> bool {
        self.get(key) != 0
    }

    /// Asks for `key`'s cache line ahead of a `get`.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        if self.len == 0 {
            return;
        }
        let (h, t) = self.locate(key);
        let slots = &self.tables[t].slots;
        if slots.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let p = &slots[(h as usize) & (slots.len() - 1)] as *const (u64, u64) as *const i8;
            // SAFETY: a prefetch is a hint; the address is in the array.
            unsafe { std::arch::x86_64::_mm_prefetch(p, std::arch::x86_64::_MM_HINT_T0) };
        }
    }

    /// Room for `n` more keys without growing (spread evenly when split).
    pub fn reserve(&mut self, n: usize) {
        self.split_if(self.len + n);
        let room = share(n, self.tables.len() == SHARDS);
        for table in &mut self.tables {
            table.reserve(room, &self.hasher);
        }
    }

    /// One table becomes `SHARDS` when the map is to hold `want` keys, past
    /// `SPLIT_AT`.
    fn split_if(&mut self, want: usize) {
        if self.tables.is_empty() {
            self.tables.push(Table::default());
        }
        if self.tables.len() == SHARDS || want < SPLIT_AT {
            return;
        }
        let old = std::mem::take(&mut self.tables).pop().unwrap_or_default();
        self.tables.resize_with(SHARDS, Table::default);
        let room = share(want, true);
        for table in &mut self.tables {
            table.reserve(room, &self.hasher);
        }
        for (k, v) in old.slots {
            if v != 0 {
                self.put(k, |_| v);
            }
        }
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
        self.split_if(self.len + 1);
        let (old, found) = self.put(key, f);
        if !found {
            self.len += 1;
        }
        old
    }

    /// `update` within the key's table, which has room or is made some;
    /// returns the old value and whether the key was there.
    #[inline]
    fn put(&mut self, key: u64, f: impl FnOnce(u64) -> u64) -> (u64, bool) {
        let (h, t) = self.locate(key);
        let table = &mut self.tables[t];
        table.reserve(1, &self.hasher);
        let (i, found) = table.find(key, h);
        let old = if found { table.slots[i].1 } else { 0 };
        table.slots[i] = (key, f(old));
        if !found {
            table.len += 1;
        }
        (old, found)
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
        if self.len == 0 {
            return;
        }
        let (h, t) = self.locate(key);
        let table = &mut self.tables[t];
        if table.len == 0 {
            return;
        }
        let (i, found) = table.find(key, h);
        if !found {
            return;
        }
        let v = f(table.slots[i].1);
        if v != 0 {
            table.slots[i].1 = v;
        } else {
            table.remove_at(i, &self.hasher);
            self.len -= 1;
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tables.iter().flat_map(|t| t.slots.iter().copied().filter(|&(_, v)| v != 0))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::CountMap;
    use crate::sharded::SPLIT_AT;

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
