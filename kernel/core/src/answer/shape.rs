//! The answer's shape (`kvconductor/index/answer_shape.py`'s
//! `PyAnswerShape`): instances in name order, their ranks, `DP` keys and
//! names as JSON, laid out once per change of owners, not per query; and
//! the JSON answer written from it. The Python edge
//! (`kernel/py/src/shape.rs`, `AnswerShape`) makes the dict answer from
//! `rows` and hands the names and keys as interned Python strings.

use std::collections::HashMap;
use std::convert::Infallible;
use std::ops::Range;

pub(crate) struct Rank {
    slot: usize,
    /// Its `DP` key, in `Shape::keys`.
    key: u32,
}

struct Instance<N> {
    /// The name in UTF-32-BE, whose byte order is code point order (that
    /// of Python's `sorted`): `Shape::instances` is sorted by it.
    order: Vec<u8>,
    /// Its (rank, slot)s in rank order, as `set_instance` gave them.
    listed: Vec<(i64, usize)>,
    name: N,
    /// The row's head in the JSON answer: the name as a JSON string
    /// (msgspec's encoding) and `:{"longest_matched":`.
    head_json: Vec<u8>,
    /// Its ranks in `Shape::ranks`: all instances' ranks in one
    /// array, read in order, where a vector per instance was a cache miss
    /// per instance after the walk (~12 us of 122 instances' answer).
    ranks: Range<usize>,
}

/// Blocks matched by one owner: GPU, CPU, DISK.
pub type Lengths = (u64, u64, u64);

/// `kvconductor/index/answer_shape.py`'s `SPARSE`.
const SPARSE: usize = 8;

/// `Shape::place` of a slot no owner has.
const NO_PLACE: u32 = u32::MAX;

/// One namespace's owners as its answers lay them out. `N`: an instance's
/// name as the caller makes rows of it (the Python edge's interned string);
/// `K`: a rank's `DP` key likewise.
pub struct Shape<N, K> {
    tenant_json: Vec<u8>,
    block_size: u64,
    /// In name order.
    instances: Vec<Instance<N>>,
    /// `DP` keys, made once per rank number, not once per owner; and
    /// each as JSON, quoted, with its colon.
    keys: Vec<K>,
    keys_json: Vec<Vec<u8>>,
    key_of: HashMap<i64, u32>,
    /// Whether an instance changed since `ranks` and `place` were laid out.
    stale: bool,
    ranks: Vec<Rank>,
    slots: usize,
    /// Per slot, its instance's index in `instances` (or `NO_PLACE`).
    place: Vec<u32>,
    /// The listed owners' lengths by slot, kept between answers with every
    /// entry None: at thousands of owners a table made for each answer was
    /// a fresh allocation and a pass to clear it, every query.
    table: Vec<Option<Lengths>>,
}

/// The listed owners' lengths by slot: a table of every slot, or (for a
/// few owners) the listed ones sorted by slot.
enum BySlot<'a> {
    Dense(&'a [Option<Lengths>]),
    Sparse(&'a [(usize, Lengths)]),
}

impl BySlot<'_> {
    #[inline]
    fn get(&self, slot: usize) -> Option<Lengths> {
        match self {
            BySlot::Dense(table) => table[slot],
            BySlot::Sparse(listed) => listed.binary_search_by_key(&slot, |l| l.0).ok().map(|i| listed[i].1),
        }
    }
}

impl<N, K> Shape<N, K> {
    /// The ranks and slots the answers read, laid out again if stale.
    fn lay_out(&mut self) {
        if !self.stale {
            return;
        }
        self.stale = false;
        self.ranks.clear();
        let mut slots = 0;
        for inst in &mut self.instances {
            let start = self.ranks.len();
            for &(rank, slot) in &inst.listed {
                slots = slots.max(slot + 1);
                self.ranks.push(Rank { slot, key: self.key_of[&rank] });
            }
            inst.ranks = start..self.ranks.len();
        }
        self.place.clear();
        self.place.resize(slots, NO_PLACE);
        for (i, inst) in self.instances.iter().enumerate() {
            for r in &self.ranks[inst.ranks.clone()] {
                self.place[r.slot] = i as u32;
            }
        }
        self.slots = slots;
    }

    /// `f` with the listed owners' lengths by slot and the instances to
    /// visit (those of the listed owners, in name order; None: all). For
    /// fewer owners than one in `SPARSE` instances (a query's
    /// `instance_id`) only theirs are visited: with thousands of owners a
    /// table and a pass over every instance were most of such an answer.
    fn with_listed<T>(
        &mut self,
        mut listed: Vec<(usize, Lengths)>,
        f: impl FnOnce(&Self, &BySlot<'_>, Option<&[u32]>) -> T,
    ) -> T {
        listed.retain(|l| l.0 < self.slots);
        if listed.len() * SPARSE < self.instances.len() {
            // A slot listed twice keeps its last lengths, as the table does.
            listed.sort_by_key(|l| l.0);
            listed.dedup_by(|later, kept| {
                let same = later.0 == kept.0;
                if same {
                    *kept = *later;
                }
                same
            });
            let mut places: Vec<u32> = listed.iter().map(|l| self.place[l.0]).filter(|&p| p != NO_PLACE).collect();
            places.sort_unstable();
            places.dedup();
            return f(self, &BySlot::Sparse(&listed), Some(&places));
        }
        let mut table = std::mem::take(&mut self.table);
        table.resize(self.slots, None);
        for &(slot, m) in &listed {
            table[slot] = Some(m);
        }
        let out = f(self, &BySlot::Dense(&table), None);
        for &(slot, _) in &listed {
            table[slot] = None;
        }
        self.table = table;
        out
    }

    /// `f` on each visited instance (`visit`: their indices; None: all)
    /// with a listed rank, in order, with its best rank's lengths (largest
    /// DISK, then GPU, then CPU; ties keep the lower rank) and its ranks
    /// (listed or not: `by_slot` says).
    fn for_rows<E>(
        &self,
        by_slot: &BySlot<'_>,
        visit: Option<&[u32]>,
        mut f: impl FnMut(&Instance<N>, Lengths, &[Rank]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut row = |inst: &Instance<N>| {
            let ranks = &self.ranks[inst.ranks.clone()];
            let mut best: Option<Lengths> = None;
            for r in ranks {
                if let Some(m) = by_slot.get(r.slot) {
                    if best.is_none_or(|b| (m.2, m.0, m.1) > (b.2, b.0, b.1)) {
                        best = Some(m);
                    }
                }
            }
            best.map_or(Ok(()), |b| f(inst, b, ranks))
        };
        match visit {
            None => self.instances.iter().try_for_each(&mut row),
            Some(places) => places.iter().try_for_each(|&p| row(&self.instances[p as usize])),
        }
    }
}

impl<N, K> Shape<N, K> {
    pub fn new(tenant_json: Vec<u8>, block_size: u64) -> Self {
        Shape {
            tenant_json,
            block_size,
            instances: Vec::new(),
            keys: Vec::new(),
            keys_json: Vec::new(),
            key_of: HashMap::new(),
            stale: true,
            ranks: Vec::new(),
            slots: 0,
            place: Vec::new(),
            table: Vec::new(),
        }
    }

    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// How many instances have a listed rank.
    pub fn instances(&self) -> usize {
        self.instances.len()
    }

    /// One instance's (rank, slot)s, in rank order, in place of what it
    /// had (none: the instance goes). `order`: its name in UTF-32-BE (code
    /// point order, Python's `sorted`); `key` makes a new rank's `DP` key.
    pub fn set_instance(
        &mut self,
        order: Vec<u8>,
        name: N,
        name_json: Vec<u8>,
        ranks: Vec<(i64, usize)>,
        mut key: impl FnMut(i64) -> K,
    ) {
        for &(rank, _) in &ranks {
            if !self.key_of.contains_key(&rank) {
                self.key_of.insert(rank, self.keys.len() as u32);
                self.keys.push(key(rank));
                self.keys_json.push(format!("\"{rank}\":").into_bytes());
            }
        }
        match self.instances.binary_search_by(|i| i.order.as_slice().cmp(&order)) {
            Ok(i) if ranks.is_empty() => {
                self.instances.remove(i);
            }
            Ok(i) => self.instances[i].listed = ranks,
            Err(_) if ranks.is_empty() => {}
            Err(i) => {
                let mut head_json = name_json;
                head_json.extend_from_slice(b":{\"longest_matched\":");
                let inst = Instance { order, listed: ranks, name, head_json, ranks: 0..0 };
                self.instances.insert(i, inst);
            }
        }
        self.stale = true;
    }

    /// `f` on each row of the answer, in name order, for the owners'
    /// lengths `listed` (slot, lengths in blocks): the instance's name, its
    /// best rank's lengths (largest DISK, then GPU, then CPU; ties keep the
    /// lower rank) and its listed ranks' `DP` keys with their lengths.
    pub fn rows<E>(
        &mut self,
        listed: Vec<(usize, Lengths)>,
        mut f: impl FnMut(&N, Lengths, &mut dyn Iterator<Item = (&K, Lengths)>) -> Result<(), E>,
    ) -> Result<(), E> {
        self.lay_out();
        self.with_listed(listed, |this, by_slot, visit| {
            this.for_rows(by_slot, visit, |inst, best, ranks| {
                let mut dp = ranks.iter().filter_map(|r| by_slot.get(r.slot).map(|m| (&this.keys[r.key as usize], m)));
                f(&inst.name, best, &mut dp)
            })
        })
    }

    /// The answer as the JSON msgspec writes for it: `{tenant:{row...}}`,
    /// or `{}` with no row. `rows`: how many rows at most (a capacity hint).
    pub fn json(&mut self, listed: Vec<(usize, Lengths)>, rows: usize) -> Vec<u8> {
        self.lay_out();
        let rows = rows.min(self.instances.len());
        self.with_listed(listed, |this, by_slot, visit| this.write_json(rows, by_slot, visit))
    }
}

impl<N, K> Shape<N, K> {
    /// The JSON answer of `rows` rows at most (a capacity hint).
    fn write_json(&self, rows: usize, by_slot: &BySlot<'_>, visit: Option<&[u32]>) -> Vec<u8> {
        // `{tenant:{` then the rows; with no row, the answer is `{}`.
        let mut out: Vec<u8> = Vec::with_capacity(64 + 96 * rows);
        out.push(b'{');
        out.extend_from_slice(&self.tenant_json);
        out.push(b':');
        let head = out.len();
        // A row is its instance's head, then a tail of numbers that rows of
        // one rank and the same lengths share: where thousands of instances
        // hold a prompt's first blocks, most rows repeat the one before.
        let mut tail: Vec<u8> = Vec::with_capacity(96);
        let mut last: Option<(Lengths, u32)> = None;
        self.for_rows(by_slot, visit, |inst, best, ranks| {
            out.push(if out.len() == head { b'{' } else { b',' });
            out.extend_from_slice(&inst.head_json);
            let key = match ranks {
                [r] => Some((best, r.key)),
                _ => None,
            };
            if key.is_none() || key != last {
                tail.clear();
                self.write_tail(&mut tail, best, ranks, by_slot);
                last = key;
            }
            out.extend_from_slice(&tail);
            Ok::<(), Infallible>(())
        })
        .unwrap_or_else(|never| match never {});
        if out.len() == head {
            return b"{}".to_vec();
        }
        out.extend_from_slice(b"}}");
        out
    }

    /// A row after its head: `longest_matched` and the tiers of the best
    /// rank, then `DP` by listed rank, closed.
    fn write_tail(&self, out: &mut Vec<u8>, (g, c, d): Lengths, ranks: &[Rank], by_slot: &BySlot<'_>) {
        let bs = self.block_size;
        let (mut num, mut disk) = (itoa::Buffer::new(), itoa::Buffer::new());
        let disk = disk.format(d * bs).as_bytes();
        // GPU and CPU mostly equal DISK: written from its digits.
        let mut number = |out: &mut Vec<u8>, n: u64| {
            out.extend_from_slice(if n == d { disk } else { num.format(n * bs).as_bytes() })
        };
        out.extend_from_slice(disk);
        out.extend_from_slice(b",\"GPU\":");
        number(out, g);
        out.extend_from_slice(b",\"CPU\":");
        number(out, c);
        out.extend_from_slice(b",\"DISK\":");
        out.extend_from_slice(disk);
        out.extend_from_slice(b",\"DP\":{");
        let mut first = true;
        for r in ranks {
            if let Some(m) = by_slot.get(r.slot) {
                if !first {
                    out.push(b',');
                }
                first = false;
                out.extend_from_slice(&self.keys_json[r.key as usize]);
                number(out, m.2);
            }
        }
        out.extend_from_slice(b"}}");
    }
}
