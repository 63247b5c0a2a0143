//! One decoded engine record applied whole to its owner in a `Store`, or
//! not at all: the engine lane's rules (`kernel/py/src/lane.rs` drives it
//! and decides, with the GIL, what the Python path must apply). The
//! record's events change the owner's tier sets first, each checked as it
//! goes (`Stage`, undone at the first event the Python path must apply);
//! then the catalog and masks follow the changes, event by event.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::engine_wire::{same, Event, Extra, Stored};
use crate::store::{Error, LaneOwner, Store, DEVICE, TIERS};

/// A context's rules for its records (the Python path's limits and
/// settings, as `EngineLane.add_context` gave them).
pub struct Rules<'a> {
    pub slot: usize,
    pub block_size: usize,
    pub seed: u64,
    pub max_blocks: usize,
    pub pool_mode: bool,
    /// The instance may re-announce held blocks (`kv-report-mode: full`).
    pub reannounces: bool,
    pub kind0: Option<&'a str>,
}

/// The namespace's pending halves, as far as a record's events reach them.
/// An answer the caller cannot give is `true` (the Python path's).
pub trait Pending {
    /// Whether content learnt for `seq` would complete a pending half
    /// (`NamespaceIndex._learn`).
    fn learns(&self, seq: u64) -> bool;
    /// Whether a pending half waits on `seq` (a removal may cancel it:
    /// `_cancel_wait`).
    fn waits_on(&self, seq: u64) -> bool;
}

/// No pending halves.
impl Pending for std::convert::Infallible {
    fn learns(&self, _: u64) -> bool {
        match *self {}
    }
    fn waits_on(&self, _: u64) -> bool {
        match *self {}
    }
}

/// What applying records counted, for the lane's counters.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Stores whose hash the catalog knew with other content.
    pub hash_conflicts: u64,
    /// Removals of hashes the owner's tier did not hold.
    pub removal_unknown: u64,
}

/// A record's scratch space, kept between records, and what it counted.
#[derive(Default)]
pub struct Work {
    changes: Changes,
    /// A store's identities, computed as it is applied.
    idents: Vec<u64>,
    /// Added to as records apply; the caller takes it.
    pub tally: Tally,
}

/// What a record applied: blocks, blocks per tier, tiers stored to (a bit each).
pub struct Applied {
    pub blocks: usize,
    pub per_tier: [u64; TIERS],
    pub stored: u8,
}

/// One change a record made to its owner's tier sets: undone when a later
/// event of the record is the Python path's, else completed in the catalog
/// and masks (`LaneOwner`). `at`: the hash's place in its event.
#[derive(Clone, Copy)]
pub(crate) struct Change {
    seq: u64,
    at: u32,
    tier: u8,
    stored: bool,
}

/// Past this many changes a record's latest change of a hash is looked up
/// in a map, not by a scan of them.
const SCAN: usize = 32;

/// A record's changes so far, event by event (`ends`), and the latest of
/// each hash when the record is long (`last`, filled as far as `synced`).
#[derive(Default)]
pub struct Changes {
    list: Vec<Change>,
    ends: Vec<usize>,
    last: HashMap<u64, bool>,
    synced: usize,
}

impl Changes {
    pub(crate) fn clear(&mut self) {
        self.list.clear();
        self.ends.clear();
        self.last.clear();
        self.synced = 0;
    }

    /// Whether the record stored (true) or removed (false) `seq` last, in any tier.
    pub(crate) fn last(&mut self, seq: u64) -> Option<bool> {
        if self.list.len() <= SCAN {
            return self.list.iter().rev().find(|c| c.seq == seq).map(|c| c.stored);
        }
        for c in &self.list[self.synced..] {
            self.last.insert(c.seq, c.stored);
        }
        self.synced = self.list.len();
        self.last.get(&seq).copied()
    }

    /// Puts the owner's tier sets back as they were before the record.
    pub(crate) fn undo(&self, owner: &mut LaneOwner<'_>) {
        for c in self.list.iter().rev() {
            if c.stored {
                owner.remove(usize::from(c.tier), c.seq);
            } else {
                owner.insert(usize::from(c.tier), c.seq);
            }
        }
    }
}

/// A record's events staged on its owner's tier sets: None as soon as an
/// event needs the Python path (the caller then undoes the changes).
struct Stage<'s, 'o, P> {
    owner: &'s mut LaneOwner<'o>,
    ctx: &'s Rules<'s>,
    changes: &'s mut Changes,
    /// With pending halves in the namespace: what they wait for.
    busy: Option<P>,
}

impl<P: Pending> Stage<'_, '_, P> {
    fn stored(&mut self, ev: &Stored<'_>, tier: usize) -> Option<()> {
        let ctx = self.ctx;
        let n = ev.hashes.len();
        let size_ok = match ev.block_size {
            None | Some(0) => true,
            Some(s) => s == ctx.block_size as i128,
        };
        let kind_ok = match (ev.kind, ctx.kind0) {
            (None, _) => true,
            (Some(kind), Some(kind0)) => same(kind.as_bytes(), kind0.as_bytes()),
            (Some(_), None) => false,
        };
        let plain = match ev.extra {
            Extra::None => true,
            Extra::Plain(k) => k == n,
            Extra::Keyed => false,
        };
        let fits = ev.tokens.as_ref().is_none_or(|t| t.len() >= n * ctx.block_size * 4);
        if n == 0
            || ev.group_idx.unwrap_or(0) != 0
            || !kind_ok
            || !size_ok
            || ev.lora_id.is_some()
            || ev.lora_name.is_some_and(|l| !l.is_empty())
            || !plain
            || (ctx.pool_mode && tier != DEVICE)
            || !fits
            || self.owner.size() + n > ctx.max_blocks
        {
            return None;
        }
        // A chain hangs from its parent's content; a token-less store (an
        // offload's) names content by its hashes, which must be known.
        // Held content is never expired or evicted before the store reads it.
        let needed: &[u64] = match (&ev.tokens, &ev.parent) {
            (Some(_), Some(p)) => std::slice::from_ref(p),
            (Some(_), None) => &[],
            (None, _) => &ev.hashes,
        };
        for &h in needed {
            let known = match self.changes.last(h) {
                Some(stored) => stored,
                None => self.owner.held_content(h).is_some(),
            };
            if !known {
                return None;
            }
        }
        if let (Some(w), Some(_)) = (&self.busy, &ev.tokens) {
            for &h in &ev.hashes {
                if w.learns(h) {
                    return None;
                }
            }
        }
        let from = self.changes.list.len();
        let mut held = 0;
        for (k, &h) in ev.hashes.iter().enumerate() {
            if self.owner.insert(tier, h) {
                self.changes.list.push(Change { seq: h, at: k as u32, tier: tier as u8, stored: true });
            } else if !self.changes.list[from..].iter().any(|c| c.seq == h) {
                held += 1; // held before this event (not a repeat within it)
            }
        }
        if held == n && ev.parent.is_none() && ctx.reannounces {
            // A re-announcement (`NamespaceIndex._copies`): nothing changes.
            return Some(());
        }
        // Some held: copies, the Python path's.
        (held == 0).then_some(())
    }

    fn removed(&mut self, hashes: &[u64], group_idx: Option<u32>, tier: usize) -> Option<()> {
        if group_idx.unwrap_or(0) != 0 || (self.ctx.pool_mode && tier != DEVICE) {
            return None;
        }
        for (k, &h) in hashes.iter().enumerate() {
            if self.owner.remove(tier, h) {
                self.changes.list.push(Change { seq: h, at: k as u32, tier: tier as u8, stored: false });
            } else if let Some(w) = &self.busy {
                // A hash not held may cancel a wait (`_cancel_wait`).
                if w.waits_on(h) {
                    return None;
                }
            }
        }
        // An emptied owner leaves its namespace: the Python path's.
        (self.owner.size() > 0).then_some(())
    }
}

impl Work {
    /// Applies one decoded record whole to its context's owner in `st`;
    /// None: nothing was applied. Its events change the owner's tier sets
    /// first, each checked as it goes (undone at the first the Python path
    /// must apply); then the catalog and masks follow the changes, event
    /// by event.
    #[allow(clippy::too_many_arguments)]
    pub fn apply<P: Pending>(
        &mut self,
        ctx: &Rules<'_>,
        st: &mut Store,
        busy: Option<P>,
        rec_now: f64,
        events: &[Event<'_>],
        tiers: &[usize],
        now: &mut f64,
    ) -> Result<Option<Applied>, Error> {
        let Some(mut owner) = st.lane_owner(ctx.slot) else { return Ok(None) };
        for (ev, &tier) in events.iter().zip(tiers) {
            let hashes = match ev {
                Event::Stored(s) => {
                    if let Some(p) = s.parent {
                        owner.prefetch(tier, p);
                    }
                    &s.hashes
                }
                Event::Removed(r) => &r.hashes,
            };
            for &h in hashes {
                owner.prefetch(tier, h);
            }
        }
        let changes = &mut self.changes;
        changes.clear();
        let mut stage = Stage { owner: &mut owner, ctx, changes, busy };
        for (ev, &tier) in events.iter().zip(tiers) {
            let ok = match ev {
                Event::Stored(s) => stage.stored(s, tier),
                Event::Removed(r) => stage.removed(&r.hashes, r.group_idx, tier),
            };
            if ok.is_none() {
                stage.changes.undo(stage.owner);
                return Ok(None);
            }
            stage.changes.ends.push(stage.changes.list.len());
        }
        if rec_now > *now {
            *now = rec_now;
        }
        // The removed blocks' mask lines, by the content the catalog (in
        // cache since the prefetch above) names, all asked for together.
        for c in changes.list.iter().filter(|c| !c.stored) {
            if let Some(ident) = owner.content(c.seq) {
                owner.prefetch_mask(usize::from(c.tier), ident);
            }
        }
        let mut out = Applied { blocks: 0, per_tier: [0; TIERS], stored: 0 };
        let mut from = 0;
        let idents = &mut self.idents;
        for ((ev, &tier), &to) in events.iter().zip(tiers).zip(&changes.ends) {
            let made = &changes.list[from..to];
            from = to;
            match ev {
                Event::Stored(s) => {
                    owner.touch_expire(*now);
                    out.stored |= 1 << tier;
                    if made.is_empty() {
                        continue; // a re-announcement
                    }
                    let n = s.hashes.len();
                    idents.clear();
                    match s.tokens.as_deref() {
                        Some(tokens) => {
                            let mut ident = match s.parent {
                                Some(p) => owner.content(p).expect("a held parent"),
                                None => ctx.seed,
                            };
                            let step = ctx.block_size * 4;
                            idents.extend(tokens[..n * step].chunks_exact(step).map(|block| {
                                ident = xxh3_64_with_seed(block, ident);
                                ident
                            }));
                        }
                        // The catalog's, as placing with no identities takes them.
                        None => idents.extend(s.hashes.iter().map(|&h| owner.content(h).expect("held content"))),
                    }
                    for ch in made {
                        owner.prefetch_mask(tier, idents[ch.at as usize]);
                    }
                    for ch in made {
                        let conflict = owner.acquire(tier, ch.seq, idents[ch.at as usize]);
                        self.tally.hash_conflicts += u64::from(conflict);
                    }
                    out.per_tier[tier] += made.len() as u64;
                    out.blocks += made.len();
                }
                Event::Removed(r) => {
                    for ch in made {
                        owner.release(tier, ch.seq)?;
                    }
                    self.tally.removal_unknown += (r.hashes.len() - made.len()) as u64;
                    out.blocks += made.len();
                }
            }
        }
        Ok(Some(out))
    }
}
