//! KV-cache groups of hybrid models and vLLM's hit over them: the compiled
//! twin of `kvconductor/index/cache_groups.py` (`GroupState`, `Prefix`,
//! `hybrid_hit`), held equal to it by tests/test_groups_kernel.py. Its
//! Python edge is kernel/py/src/groups.rs.
//!
//! A group's block is keyed by the content of the prefix it ends (`Prefix::key`),
//! so a query's keys are the same for every owner: they are computed once
//! a query, on the grid of each block size asked for, and every owner's
//! groups are looked up against them.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// `cache_groups._SUB_SEED`: seeds a key that ends inside an alignment unit.
const SUB_SEED: u64 = 0x6B76_6361_6368_6521;

/// How a group is looked up (`cache_groups`' kind sets).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Every block of the prefix (full, MLA, sink attention; unknown kinds).
    Full,
    /// The window's tail blocks ending at the hit point.
    Window,
    /// The state block ending exactly at the hit point (Mamba).
    State,
    /// The blocks from the start of the chunk holding the hit point.
    Local,
}

/// One (instance, dp rank)'s blocks in one non-primary group: copies per
/// engine hash, and per key.
#[derive(Clone, Debug)]
pub struct Group {
    pub kind: Kind,
    pub block_size: usize,
    pub window: Option<usize>,
    /// engine hash -> (key, copies)
    held: HashMap<u64, (u64, u32)>,
    /// key -> copies
    keys: HashMap<u64, u32>,
}

impl Group {
    pub fn new(kind: Kind, block_size: usize, window: Option<usize>) -> Self {
        Group { kind, block_size, window, held: HashMap::new(), keys: HashMap::new() }
    }

    /// Engine hashes held (not copies).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Hold one more copy of a block; a hash held already keeps its key.
    pub fn add(&mut self, seq: u64, key: u64) {
        let entry = self.held.entry(seq).or_insert((key, 0));
        entry.1 += 1;
        *self.keys.entry(entry.0).or_insert(0) += 1;
    }

    /// One copy of `seq` leaves; false if the group does not hold it.
    pub fn remove(&mut self, seq: u64) -> bool {
        let Some(entry) = self.held.get_mut(&seq) else {
            return false;
        };
        let key = entry.0;
        entry.1 -= 1;
        if entry.1 == 0 {
            self.held.remove(&seq);
        }
        let left = self.keys.get_mut(&key).expect("a held block's key");
        *left -= 1;
        if *left == 0 {
            self.keys.remove(&key);
        }
        true
    }

    pub fn clear(&mut self) -> usize {
        let n = self.held.len();
        self.held.clear();
        self.keys.clear();
        n
    }

    /// (engine hash, key, copies), by hash.
    pub fn export(&self) -> Vec<(u64, u64, u32)> {
        let mut out: Vec<_> = self.held.iter().map(|(&s, &(k, n))| (s, k, n)).collect();
        out.sort_unstable();
        out
    }

    fn has(&self, key: Option<u64>) -> bool {
        key.is_some_and(|k| self.keys.contains_key(&k))
    }

    /// Checked at each candidate hit point (else its run caps the hit). A
    /// chunked local group without its chunk size is full attention over
    /// its own blocks.
    pub fn pointwise(&self) -> bool {
        match self.kind {
            Kind::State | Kind::Window => true,
            Kind::Local => self.window.is_some_and(|w| w > 0),
            Kind::Full => false,
        }
    }

    /// Full attention's hit over this group's own blocks, in alignment
    /// units, at most `limit`: its run of blocks from the first, floored.
    pub fn full_run(&self, prefix: &mut Prefix<'_>, limit: usize) -> usize {
        let bs = self.block_size;
        let grid = prefix.grid(bs, limit * prefix.align);
        let run = grid.iter().take_while(|&&k| self.has(k)).count();
        run * bs / prefix.align
    }

    /// Whether this group can serve a hit ending at each multiple of the
    /// alignment, `limit` of them from 0, into `out`.
    pub fn serving(&self, prefix: &mut Prefix<'_>, limit: usize, out: &mut Vec<bool>) {
        out.clear();
        let align = prefix.align;
        if self.kind == Kind::State {
            out.push(true);
            for units in 1..=limit {
                let key = prefix.key(units * align);
                out.push(self.has(key));
            }
            return;
        }
        let (Some(window), Kind::Window | Kind::Local) = (self.window, self.kind) else {
            out.resize(limit + 1, true);
            return;
        };
        let bs = self.block_size;
        // run[j]: held blocks in a row ending at token (j + 1) * bs.
        let mut run = Vec::new();
        let mut last = 0usize;
        for &key in prefix.grid(bs, limit * align) {
            last = if self.has(key) { last + 1 } else { 0 };
            run.push(last);
        }
        let need = (window.saturating_sub(1)).div_ceil(bs);
        out.push(true);
        for units in 1..=limit {
            let point = units * align;
            let start =
                if self.kind == Kind::Window { point.saturating_sub(need * bs) } else { (point - 1) / window * window };
            let span = point - start;
            out.push(span.is_multiple_of(bs) && point.is_multiple_of(bs) && run[point / bs - 1] >= span / bs);
        }
    }
}

/// A query's prefix keys at any block end: the identity at each multiple of
/// `align` (`idents[m]` ends at `(m + 1) * align`) and, for an end inside a
/// unit, the tokens since the unit's start (`packed`, little-endian u32;
/// None for a query by engine hashes).
pub struct Prefix<'a> {
    packed: Option<&'a [u8]>,
    base: u64,
    pub align: usize,
    idents: &'a [u64],
    /// block size -> the keys ending at its multiples, as far as asked.
    grids: HashMap<usize, Vec<Option<u64>>>,
}

impl<'a> Prefix<'a> {
    pub fn new(packed: Option<&'a [u8]>, base: u64, align: usize, idents: &'a [u64]) -> Self {
        Prefix { packed, base, align, idents, grids: HashMap::new() }
    }

    pub fn units(&self) -> usize {
        self.idents.len()
    }

    /// The key of the block ending at token `end`; None past what is known.
    pub fn key(&self, end: usize) -> Option<u64> {
        let (whole, part) = (end / self.align, end % self.align);
        if whole > self.idents.len() || end == 0 {
            return None;
        }
        let ident = if whole == 0 { self.base } else { self.idents[whole - 1] };
        if part == 0 {
            return Some(ident);
        }
        let packed = self.packed?;
        if packed.len() < end * 4 {
            return None;
        }
        Some(xxh3_64_with_seed(&packed[whole * self.align * 4..end * 4], ident ^ SUB_SEED))
    }

    /// The keys of the blocks ending at `step`, `2 * step`, ... up to token
    /// `upto`.
    pub fn grid(&mut self, step: usize, upto: usize) -> &[Option<u64>] {
        let n = upto / step;
        let mut keys = self.grids.remove(&step).unwrap_or_default();
        let from = keys.len();
        keys.extend((from..n).map(|j| self.key((j + 1) * step)));
        let keys = self.grids.entry(step).or_insert(keys);
        &keys[..n]
    }
}

/// vLLM's hit in alignment units, at most `limit`: the largest multiple of
/// it not above any full-attention group's run at which every other group's
/// rule holds (kv_cache_coordinator's fixed point, in one pass).
pub fn hybrid_hit(groups: &[&Group], prefix: &mut Prefix<'_>, limit: usize, scratch: &mut Vec<Vec<bool>>) -> usize {
    let mut limit = limit;
    for g in groups.iter().filter(|g| !g.pointwise()) {
        limit = limit.min(g.full_run(prefix, limit));
    }
    let pointwise: Vec<&&Group> = groups.iter().filter(|g| g.pointwise()).collect();
    scratch.resize_with(pointwise.len(), Vec::new);
    for (g, out) in pointwise.iter().zip(scratch.iter_mut()) {
        g.serving(prefix, limit, out);
    }
    let serving = &scratch[..pointwise.len()];
    (1..=limit).rev().find(|&u| serving.iter().all(|s| s[u])).unwrap_or(0)
}

/// The identities of `packed`'s whole `align`-token blocks from `base`
/// (`hashing.chain_identities` without extra keys).
pub fn chain(packed: &[u8], align: usize, base: u64) -> Vec<u64> {
    let mut ident = base;
    packed
        .chunks_exact(align * 4)
        .map(|b| {
            ident = xxh3_64_with_seed(b, ident);
            ident
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(n: usize) -> Vec<u8> {
        (0..n as u32).flat_map(|t| (t * 7 + 1).to_le_bytes()).collect()
    }

    #[test]
    fn copies_leave_one_at_a_time() {
        let mut g = Group::new(Kind::Window, 4, Some(8));
        g.add(1, 10);
        g.add(1, 99); // a copy keeps the first key
        assert_eq!(g.export(), vec![(1, 10, 2)]);
        assert!(g.remove(1));
        assert_eq!(g.len(), 1);
        assert!(g.remove(1));
        assert!(g.is_empty() && !g.remove(1));
    }

    #[test]
    fn a_window_needs_its_tail_and_full_caps_the_hit() {
        let data = packed(32);
        let idents = chain(&data, 4, 1337);
        let mut prefix = Prefix::new(Some(&data), 1337, 4, &idents);
        let mut full = Group::new(Kind::Full, 4, None);
        let mut window = Group::new(Kind::Window, 4, Some(8)); // two blocks a hit
        for u in 1..=8 {
            full.add(u as u64, prefix.key(u * 4).unwrap());
        }
        for u in [2usize, 3, 6] {
            window.add(100 + u as u64, prefix.key(u * 4).unwrap());
        }
        let mut scratch = Vec::new();
        // Tails held: ending at 3 (blocks 2, 3); 6 alone lacks block 5.
        assert_eq!(hybrid_hit(&[&full, &window], &mut prefix, 8, &mut scratch), 3);
        assert!(full.remove(3));
        // Full attention now ends at 2, where the window lacks block 1.
        assert_eq!(hybrid_hit(&[&full, &window], &mut prefix, 8, &mut scratch), 0);
    }

    #[test]
    fn a_state_needs_its_block_at_the_point_and_keys_inside_a_unit() {
        let data = packed(16);
        let idents = chain(&data, 8, 7);
        let prefix = Prefix::new(Some(&data), 7, 8, &idents);
        assert_eq!(prefix.key(8), Some(idents[0]));
        let inner = prefix.key(12).unwrap();
        assert_eq!(inner, xxh3_64_with_seed(&data[32..48], idents[0] ^ SUB_SEED));
        assert_eq!(Prefix::new(None, 7, 8, &idents).key(12), None);
        assert_eq!(prefix.key(24), None);
        let mut state = Group::new(Kind::State, 8, None);
        state.add(5, idents[1]);
        let mut prefix = prefix;
        let mut scratch = Vec::new();
        assert_eq!(hybrid_hit(&[&state], &mut prefix, 2, &mut scratch), 2);
        assert_eq!(hybrid_hit(&[&state], &mut prefix, 1, &mut scratch), 0);
    }
}
