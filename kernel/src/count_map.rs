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
//! (`Tables`; the catalog, `sharded::ShardedMap`, is laid out the same way).

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

use crate::sharded::{share, shard_of, SHARDS, SHARD_BITS, SPLIT_AT};

/// At most this share of slots in use (in eighths): a miss scans on to an
/// empty slot, and longer runs make misses slower.
const MAX_LOAD_EIGHTHS: usize = 6;

/// A table grows by this share of its size (in quarters) beyond what it is
/// to hold at the most load, not by doubling: its load stays between 60 and
/// 75%, where doubling left it anywhere from 37.5% (a fresh doubling: 43
/// bytes a key) to 75%. The price is rehashing a key five times over its
/// life instead of twice, a table (a sixty-fourth of a large map) at a time.
const GROW_QUARTERS: usize = 5;

/// A key's slot of `n`: the hash's bits scaled to `[0, n)` (any `n`, not
/// only a power of two). The top bits choose a map's shard, so they are
/// rotated away first: within a shard they are all the same.
#[inline]
pub(crate) fn home(h: u64, n: usize) -> usize {
    ((u128::from(h.rotate_left(SHARD_BITS)) * n as u128) >> 64) as usize
}

/// What a table holds in a slot: a key and maybe a value, with one value
/// of the slot marking it empty.
pub(crate) trait Slot: Copy {
    const EMPTY: Self;
    fn key(self) -> u64;
    fn used(self) -> bool;
}

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

/// One table: an array of slots, `len` in use.
pub(crate) struct Table<S> {
    pub(crate) slots: Vec<S>,
    pub(crate) len: usize,
}

impl<S> Default for Table<S> {
    fn default() -> Self {
        Table { slots: Vec::new(), len: 0 }
    }
}

impl<S: Slot> Table<S> {
    /// Where `key` (hashed to `h`) is, or the empty slot that ends its run.
    #[inline]
    pub(crate) fn find(&self, key: u64, h: u64) -> (usize, bool) {
        let n = self.slots.len();
        let mut i = home(h, n);
        loop {
            let s = self.slots[i];
            if !s.used() {
                return (i, false);
            }
            if s.key() == key {
                return (i, true);
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    /// Asks for the cache line of the home of a key hashed to `h`.
    #[inline]
    pub(crate) fn prefetch(&self, h: u64) {
        if self.slots.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let p = &self.slots[home(h, self.slots.len())] as *const S as *const i8;
            // SAFETY: a prefetch is a hint; the address is in the array.
            unsafe { std::arch::x86_64::_mm_prefetch(p, std::arch::x86_64::_MM_HINT_T0) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = h;
    }

    /// Room for `n` more keys without growing (the check inline: every
    /// insert makes it; the growth apart).
    #[inline]
    pub(crate) fn reserve(&mut self, n: usize, hasher: &RandomState) {
        let want = self.len + n;
        if want * 8 > self.slots.len() * MAX_LOAD_EIGHTHS {
            self.grow(want, hasher);
        }
    }

    #[inline(never)]
    fn grow(&mut self, want: usize, hasher: &RandomState) {
        let capacity = (want * 8 / MAX_LOAD_EIGHTHS * GROW_QUARTERS / 4).max(8);
        let old = std::mem::replace(&mut self.slots, vec![S::EMPTY; capacity]);
        let n = self.slots.len();
        for s in old {
            if s.used() {
                // Keys are distinct: the first empty slot from home is its place.
                let mut i = home(hasher.hash_one(s.key()), n);
                while self.slots[i].used() {
                    i += 1;
                    if i == n {
                        i = 0;
                    }
                }
                self.slots[i] = s;
            }
        }
    }

    /// Backward-shift deletion: every later key of the run that may move
    /// closer to its home fills the hole, so runs stay unbroken.
    pub(crate) fn remove_at(&mut self, mut hole: usize, hasher: &RandomState) {
        let n = self.slots.len();
        let mut i = hole;
        // How far `i` is past the hole, going round.
        let mut gap = 0;
        loop {
            i = if i + 1 == n { 0 } else { i + 1 };
            gap += 1;
            let s = self.slots[i];
            if !s.used() {
                break;
            }
            let at = home(hasher.hash_one(s.key()), n);
            // The key may move to the hole if its home is not in (hole, i].
            let from_home = if i >= at { i - at } else { i + n - at };
            if from_home >= gap {
                self.slots[hole] = s;
                hole = i;
                gap = 0;
            }
        }
        self.slots[hole] = S::EMPTY;
        self.len -= 1;
        if self.len == 0 {
            self.slots = Vec::new();
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = S> + '_ {
        self.slots.iter().copied().filter(|s| s.used())
    }
}

/// Tables of slots, one or (past `SPLIT_AT` keys) `SHARDS` of them by the
/// top bits of a key's hash, so that growing rehashes one table, not all
/// of them: at a million keys one growth of all of them stopped the event
/// loop for a noticeable pause. The maps over it (`CountMap`,
/// `sharded::ShardedMap`) give the slots their meaning.
pub(crate) struct Tables<S> {
    tables: Vec<Table<S>>,
    len: usize,
    hasher: RandomState,
}

impl<S> Default for Tables<S> {
    fn default() -> Self {
        Tables { tables: Vec::new(), len: 0, hasher: RandomState::default() }
    }
}

impl<S: Slot> Tables<S> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// `key`'s hash and its table.
    #[inline]
    fn locate(&self, key: u64) -> (u64, usize) {
        let h = self.hasher.hash_one(key);
        let t = if self.tables.len() == SHARDS { shard_of(h) } else { 0 };
        (h, t)
    }

    /// `key`'s slot, when it is there.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&S> {
        if self.len == 0 {
            return None;
        }
        let (h, t) = self.locate(key);
        let table = &self.tables[t];
        if table.len == 0 {
            return None;
        }
        match table.find(key, h) {
            (i, true) => Some(&table.slots[i]),
            _ => None,
        }
    }

    /// `key`'s slot (its hash, table and place), when it is there.
    #[inline]
    fn position(&self, key: u64) -> Option<(usize, usize)> {
        if self.len == 0 {
            return None;
        }
        let (h, t) = self.locate(key);
        let table = &self.tables[t];
        if table.len == 0 {
            return None;
        }
        match table.find(key, h) {
            (i, true) => Some((t, i)),
            _ => None,
        }
    }

    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut S> {
        let (t, i) = self.position(key)?;
        Some(&mut self.tables[t].slots[i])
    }

    /// Asks for `key`'s cache line ahead of a `get`.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.len == 0 {
            return;
        }
        let (h, t) = self.locate(key);
        self.tables[t].prefetch(h);
    }

    /// Room for `n` more keys without growing (spread evenly when split).
    pub(crate) fn reserve(&mut self, n: usize) {
        self.split_if(self.len + n);
        let room = share(n, self.tables.len() == SHARDS);
        for table in &mut self.tables {
            table.reserve(room, &self.hasher);
        }
    }

    /// One table becomes `SHARDS` when the map is to hold `want` keys, past
    /// `SPLIT_AT` (the check inline: every insert makes it).
    #[inline]
    fn split_if(&mut self, want: usize) {
        if self.tables.len() != SHARDS && (self.tables.is_empty() || want >= SPLIT_AT) {
            self.split(want);
        }
    }

    #[inline(never)]
    fn split(&mut self, want: usize) {
        if self.tables.is_empty() {
            self.tables.push(Table::default());
        }
        if want < SPLIT_AT {
            return;
        }
        let old = std::mem::take(&mut self.tables).pop().unwrap_or_default();
        self.tables.resize_with(SHARDS, Table::default);
        let room = share(want, true);
        for table in &mut self.tables {
            table.reserve(room, &self.hasher);
        }
        // Counted again as they go in.
        self.len = 0;
        for s in old.iter() {
            let (slot, _) = self.slot_for(s.key());
            *slot = s;
        }
    }

    /// `key`'s slot, made room for if absent (then empty: the caller fills
    /// it); whether it was there. The slot must not be left empty.
    #[inline]
    pub(crate) fn slot_for(&mut self, key: u64) -> (&mut S, bool) {
        self.split_if(self.len + 1);
        let (h, t) = self.locate(key);
        let table = &mut self.tables[t];
        table.reserve(1, &self.hasher);
        let (i, found) = table.find(key, h);
        if !found {
            table.len += 1;
            self.len += 1;
        }
        (&mut table.slots[i], found)
    }

    /// `f` on `key`'s slot, when it is there, in one probe; the slot is
    /// taken out when `f` says so (it may leave it empty then).
    pub(crate) fn change(&mut self, key: u64, f: impl FnOnce(&mut S) -> bool) {
        let Some((t, i)) = self.position(key) else { return };
        let table = &mut self.tables[t];
        if f(&mut table.slots[i]) {
            table.remove_at(i, &self.hasher);
            self.len -= 1;
        }
    }

    /// Takes `key`'s slot out; what it held.
    pub(crate) fn remove(&mut self, key: u64) -> Option<S> {
        let (t, i) = self.position(key)?;
        let table = &mut self.tables[t];
        let s = table.slots[i];
        table.remove_at(i, &self.hasher);
        self.len -= 1;
        Some(s)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &S> + '_ {
        self.tables.iter().flat_map(|t| t.slots.iter().filter(|s| s.used()))
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
