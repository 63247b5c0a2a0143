//! `CountMap`: identity -> non-zero u64 (owner bits, or a holder count), the
//! maps the query walk probes.
//!
//! Open addressing with linear probing over one array of (key, value)
//! pairs, so that a probe reads one cache line where a SwissTable reads its
//! control bytes and then its bucket, and so that the walk can prefetch a
//! chunk of blocks' lines before it reads any (see `store::GATHER`): at
//! four million entries hashbrown's two dependent misses per probe were
//! most of a query. A value of 0 marks an empty slot (a key whose value
//! drops to 0 is removed), and deletion shifts the run back, so there are
//! no tombstones. Keys are hashed with foldhash's per-process random seed,
//! as the other maps are: they come from engines.

use std::hash::BuildHasher;

use foldhash::fast::RandomState;

/// At most this share of slots in use (in eighths): a miss scans on to an
/// empty slot, and longer runs make misses slower.
const MAX_LOAD_EIGHTHS: usize = 6;

#[derive(Default)]
pub struct CountMap {
    slots: Vec<(u64, u64)>,
    len: usize,
    hasher: RandomState,
}

impl CountMap {
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (self.hasher.hash_one(key) as usize) & (self.slots.len() - 1)
    }

    /// Where `key` is, or the empty slot that ends its run.
    #[inline]
    fn find(&self, key: u64) -> (usize, bool) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
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

    #[inline]
    pub fn get(&self, key: u64) -> u64 {
        if self.len == 0 {
            return 0;
        }
        match self.find(key) {
            (i, true) => self.slots[i].1,
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
        #[cfg(target_arch = "x86_64")]
        {
            let p = &self.slots[self.home(key)] as *const (u64, u64) as *const i8;
            // SAFETY: a prefetch is a hint; the address is in the array.
            unsafe { std::arch::x86_64::_mm_prefetch(p, std::arch::x86_64::_MM_HINT_T0) };
        }
    }

    /// Room for `n` more keys without growing.
    pub fn reserve(&mut self, n: usize) {
        let want = self.len + n;
        if want * 8 > self.slots.len() * MAX_LOAD_EIGHTHS {
            self.resize((want * 8 / MAX_LOAD_EIGHTHS + 1).next_power_of_two().max(8));
        }
    }

    fn resize(&mut self, capacity: usize) {
        let old = std::mem::replace(&mut self.slots, vec![(0, 0); capacity]);
        for (k, v) in old {
            if v != 0 {
                let (i, _) = self.find(k);
                self.slots[i] = (k, v);
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
        self.reserve(1);
        let (i, found) = self.find(key);
        let old = if found { self.slots[i].1 } else { 0 };
        self.slots[i] = (key, f(old));
        self.len += usize::from(!found);
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
        if self.len == 0 {
            return;
        }
        let (i, found) = self.find(key);
        if !found {
            return;
        }
        let v = f(self.slots[i].1);
        if v != 0 {
            self.slots[i].1 = v;
        } else {
            self.remove_at(i);
        }
    }

    /// Backward-shift deletion: every later key of the run that may move
    /// closer to its home fills the hole, so runs stay unbroken.
    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.slots.len() - 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let (k, v) = self.slots[i];
            if v == 0 {
                break;
            }
            let home = self.home(k);
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

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots.iter().copied().filter(|&(_, v)| v != 0)
    }
}
