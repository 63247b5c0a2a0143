//! The linear-probing tables under every map here (`CountMap`,
//! `ShardedMap`, `SeqSet`): open addressing over one array of slots (of any
//! length: see `GROW_QUARTERS`), no tombstones (deletion shifts the run
//! back), split into `SHARDS` tables by the top bits of the hash past
//! `SPLIT_AT` keys so that a growth rehashes a sixty-fourth of them.
//! Keys are hashed with foldhash's per-process random seed: they come
//! from engines. Why this layout: README.md.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

pub const SHARD_BITS: u32 = 6;
pub const SHARDS: usize = 1 << SHARD_BITS;
/// Keys at which a map splits: small enough that one growth is short.
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
pub fn home(h: u64, n: usize) -> usize {
    ((u128::from(h.rotate_left(SHARD_BITS)) * n as u128) >> 64) as usize
}

/// What a table holds in a slot: a key and maybe a value, with one value
/// of the slot marking it empty.
pub trait Slot: Copy {
    const EMPTY: Self;
    fn key(self) -> u64;
    fn used(self) -> bool;
}

/// One table: an array of slots, `len` in use.
pub struct Table<S> {
    pub slots: Vec<S>,
    pub len: usize,
}

impl<S> Default for Table<S> {
    fn default() -> Self {
        Table { slots: Vec::new(), len: 0 }
    }
}

impl<S: Slot> Table<S> {
    /// Where `key` (hashed to `h`) is, or the empty slot that ends its run.
    #[inline]
    pub fn find(&self, key: u64, h: u64) -> (usize, bool) {
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
    pub fn prefetch(&self, h: u64) {
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
    pub fn reserve(&mut self, n: usize, hasher: &RandomState) {
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
    pub fn remove_at(&mut self, mut hole: usize, hasher: &RandomState) {
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

    pub fn iter(&self) -> impl Iterator<Item = S> + '_ {
        self.slots.iter().copied().filter(|s| s.used())
    }
}

/// Tables of slots, one or (past `SPLIT_AT` keys) `SHARDS` of them by the
/// top bits of a key's hash, so that growing rehashes one table, not all
/// of them: at a million keys one growth of all of them stopped the event
/// loop for a noticeable pause. The maps over it (`CountMap`,
/// `sharded::ShardedMap`) give the slots their meaning.
pub struct Tables<S> {
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
    pub fn len(&self) -> usize {
        self.len
    }

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

    /// `key`'s slot, when it is there.
    #[inline]
    pub fn get(&self, key: u64) -> Option<&S> {
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

    pub fn get_mut(&mut self, key: u64) -> Option<&mut S> {
        let (t, i) = self.position(key)?;
        Some(&mut self.tables[t].slots[i])
    }

    /// Asks for `key`'s cache line ahead of a `get`.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        if self.len == 0 {
            return;
        }
        let (h, t) = self.locate(key);
        self.tables[t].prefetch(h);
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
    pub fn slot_for(&mut self, key: u64) -> (&mut S, bool) {
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
    pub fn change(&mut self, key: u64, f: impl FnOnce(&mut S) -> bool) {
        let Some((t, i)) = self.position(key) else { return };
        let table = &mut self.tables[t];
        if f(&mut table.slots[i]) {
            table.remove_at(i, &self.hasher);
            self.len -= 1;
        }
    }

    /// Takes `key`'s slot out; what it held.
    pub fn remove(&mut self, key: u64) -> Option<S> {
        let (t, i) = self.position(key)?;
        let table = &mut self.tables[t];
        let s = table.slots[i];
        table.remove_at(i, &self.hasher);
        self.len -= 1;
        Some(s)
    }

    pub fn iter(&self) -> impl Iterator<Item = &S> + '_ {
        self.tables.iter().flat_map(|t| t.slots.iter().filter(|s| s.used()))
    }
}
