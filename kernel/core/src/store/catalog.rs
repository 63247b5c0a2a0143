//! The catalog: sequence hash -> content identity, holder count and
//! retired-queue stamp, with the retired entries' FIFO (lazy deletion: a
//! record is live while its entry is unheld and still carries the record's
//! stamp). `PendingQueue`'s semantics.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashMap;

use super::Error;
use crate::maps::{ShardedMap, Vacant};

/// One process-wide sequence, so that a namespace dropped and created again
/// never repeats a version a snapshot already published.
static CHANGES: AtomicU64 = AtomicU64::new(0);

pub(crate) fn next_version() -> u64 {
    CHANGES.fetch_add(1, Ordering::Relaxed) + 1
}

// ------------------------------------------------------------------ catalog

#[derive(Clone, Copy)]
pub(crate) struct Block {
    pub(crate) ident: u64,
    /// Holders; 0: retired (queued). Never `u32::MAX` (an empty slot's).
    pub(crate) refs: u32,
    /// The stamp of the block's live retired record, when retired. Stamps
    /// wrap at 2^32; a stale record could only be mistaken for a live one
    /// after 2^32 newer records, more than the queue can hold (compaction
    /// keeps it below twice its live records).
    stamp: u32,
}

impl Vacant for Block {
    const VACANT: Self = Block { ident: 0, refs: u32::MAX, stamp: 0 };
    fn is_vacant(&self) -> bool {
        self.refs == u32::MAX
    }
}

pub(crate) struct Record {
    seq: u64,
    ts: f64,
    stamp: u32,
}

/// Sequence hash -> content, with the retired entries' FIFO: `PendingQueue`
/// semantics (append unless present, evict the oldest beyond the count
/// bound, expire from the head by age).
pub(crate) struct Catalog {
    pub(crate) map: ShardedMap<Block>,
    queue: VecDeque<Record>,
    pub(crate) live: usize,
    next_stamp: u32,
    pub(crate) max_entries: usize,
    max_age_s: f64,
    pub(crate) version: u64,
    pub(crate) now: f64,
    /// While a cut is open (`begin_cut`): what the catalog forgot since,
    /// with the identity it had, for `cut_identities`.
    pub(crate) forgotten: Option<HashMap<u64, u64>>,
    pub(crate) cuts: u32,
}

impl Catalog {
    pub(crate) fn new(max_entries: usize, max_age_s: f64) -> Self {
        Catalog {
            map: ShardedMap::default(),
            queue: VecDeque::new(),
            live: 0,
            next_stamp: 0,
            max_entries,
            max_age_s,
            version: 0,
            now: 0.0,
            forgotten: None,
            cuts: 0,
        }
    }

    /// Takes `seq` out of the map, keeping its identity while a cut is open.
    pub(crate) fn forget(&mut self, seq: u64) {
        if let Some(b) = self.map.remove(&seq) {
            if let Some(kept) = &mut self.forgotten {
                kept.entry(seq).or_insert(b.ident);
            }
        }
    }

    /// The catalog entry of a live record (unheld, still carrying its stamp).
    pub(crate) fn live<'m>(map: &'m ShardedMap<Block>, r: &Record) -> Option<&'m Block> {
        map.get(&r.seq).filter(|b| b.refs == 0 && b.stamp == r.stamp)
    }

    pub(crate) fn ident(&self, seq: u64) -> Option<u64> {
        self.map.get(&seq).map(|b| b.ident)
    }

    /// The identity of a block some tier holds (always in the catalog).
    pub(crate) fn held_ident(&self, seq: u64) -> u64 {
        self.ident(seq).unwrap_or_default()
    }

    /// A reference on `seq`'s content; its canonical identity.
    pub(crate) fn acquire(&mut self, seq: u64, ident: u64) -> u64 {
        let (b, new) = self.map.get_or_insert_with(seq, || Block { ident, refs: 0, stamp: 0 });
        let revived = !new && b.refs == 0;
        b.refs += 1;
        let canon = b.ident;
        if revived {
            self.unqueued();
        }
        canon
    }

    /// Drops a reference; returns the identity (the entry may be gone when
    /// the retired bound evicted it at once).
    pub(crate) fn release(&mut self, seq: u64) -> Result<u64, Error> {
        let stamp = self.next_stamp;
        let b = match self.map.get_mut(&seq) {
            Some(b) if b.refs > 0 => b,
            _ => return Err(Error::NotHeld(seq)),
        };
        b.refs -= 1;
        let ident = b.ident;
        if b.refs == 0 {
            b.stamp = stamp;
            let now = self.now;
            self.enqueue(seq, now);
        }
        Ok(ident)
    }

    /// Known content nobody holds, retired at `ts`, unless the catalog has it.
    pub(crate) fn retire_new(&mut self, seq: u64, ident: u64, ts: f64) {
        let stamp = self.next_stamp;
        if self.map.get_or_insert_with(seq, || Block { ident, refs: 0, stamp }).1 {
            self.enqueue(seq, ts);
        }
    }

    /// Queues the block just retired with stamp `next_stamp`.
    pub(crate) fn enqueue(&mut self, seq: u64, ts: f64) {
        let stamp = self.next_stamp;
        self.next_stamp = stamp.wrapping_add(1);
        self.queue.push_back(Record { seq, ts, stamp });
        self.live += 1;
        self.version = next_version();
        while self.live > self.max_entries && self.drop_head() {}
    }

    /// A retired block was taken back: its record goes stale.
    pub(crate) fn unqueued(&mut self) {
        self.live -= 1;
        self.version = next_version();
        if self.queue.len() > 2 * self.live + 64 {
            let map = &self.map;
            self.queue.retain(|r| Catalog::live(map, r).is_some());
        }
    }

    /// The oldest live record's retirement time, past stale ones.
    pub(crate) fn head_ts(&mut self) -> Option<f64> {
        while let Some(r) = self.queue.front() {
            if Catalog::live(&self.map, r).is_some() {
                return Some(r.ts);
            }
            self.queue.pop_front();
        }
        None
    }

    /// Forgets the oldest live retired entry; false when there is none.
    pub(crate) fn drop_head(&mut self) -> bool {
        if self.head_ts().is_none() {
            return false;
        }
        if let Some(r) = self.queue.pop_front() {
            self.forget(r.seq);
            self.live -= 1;
            self.version = next_version();
        }
        true
    }

    pub(crate) fn expire(&mut self, now: f64) {
        let cutoff = now - self.max_age_s;
        while let Some(ts) = self.head_ts() {
            // Not `ts < cutoff`: a NaN clock expires, as in `PendingQueue`.
            if ts >= cutoff {
                return;
            }
            self.drop_head();
        }
    }

    pub(crate) fn retired(&self) -> impl Iterator<Item = (u64, u64, f64)> + '_ {
        self.queue.iter().filter_map(|r| Catalog::live(&self.map, r).map(|b| (r.seq, b.ident, r.ts)))
    }

    pub(crate) fn clear_retired(&mut self) {
        for r in std::mem::take(&mut self.queue) {
            if Catalog::live(&self.map, &r).is_some() {
                self.forget(r.seq);
            }
        }
        if self.live > 0 {
            self.live = 0;
            self.version = next_version();
        }
    }
}
