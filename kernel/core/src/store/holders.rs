//! Owner tiers and pool stores as `Holder`s, and what is done to either:
//! `place`, `unplace`, `clear`, `load` (`PyBlockStore._place_*` and co.).

use hashbrown::hash_map::Entry;
use hashbrown::HashMap;

use super::catalog::Catalog;
use super::{unpack, Error};
use crate::maps::{CountMap, SeqSet};

/// An owner tier or a pool store: the sequence hashes it holds and the
/// query map it keeps counted.
pub(crate) trait Holder {
    fn set(&mut self) -> &mut SeqSet;
    fn count(&mut self, seq: u64, ident: u64);
    fn uncount(&mut self, ident: u64);
    /// Room for `n` more blocks.
    fn reserve(&mut self, n: usize);
}

pub(crate) struct OwnerTier<'a> {
    pub(crate) set: &'a mut SeqSet,
    /// The tier's masks for the owner's 64-slot word.
    pub(crate) masks: &'a mut CountMap,
    /// (tier, identity) -> holders beyond the first.
    pub(crate) dups: &'a mut HashMap<(u8, u64), u32>,
    pub(crate) tier: u8,
    pub(crate) bit: u64,
}

impl Holder for OwnerTier<'_> {
    fn set(&mut self) -> &mut SeqSet {
        self.set
    }

    fn reserve(&mut self, n: usize) {
        self.set.reserve(n);
        self.masks.reserve(n);
    }

    fn count(&mut self, _: u64, ident: u64) {
        if self.masks.or(ident, self.bit) & self.bit != 0 {
            *self.dups.entry((self.tier, ident)).or_insert(0) += 1;
        }
    }

    fn uncount(&mut self, ident: u64) {
        // Most owners hold no copies: no probe of an empty map.
        if !self.dups.is_empty() {
            if let Entry::Occupied(mut o) = self.dups.entry((self.tier, ident)) {
                if *o.get() == 1 {
                    o.remove();
                } else {
                    *o.get_mut() -= 1;
                }
                return;
            }
        }
        self.masks.clear_bits(ident, self.bit);
    }
}

pub(crate) struct PoolBlocks<'a> {
    pub(crate) set: &'a mut SeqSet,
    pub(crate) counts: &'a mut CountMap,
    /// Where newly held hashes are reported.
    pub(crate) placed_out: Option<&'a mut Vec<u64>>,
}

impl Holder for PoolBlocks<'_> {
    fn set(&mut self) -> &mut SeqSet {
        self.set
    }

    fn reserve(&mut self, n: usize) {
        self.set.reserve(n);
        self.counts.reserve(n);
    }

    fn count(&mut self, seq: u64, ident: u64) {
        self.counts.increment(ident);
        if let Some(out) = &mut self.placed_out {
            out.push(seq);
        }
    }

    fn uncount(&mut self, ident: u64) {
        self.counts.decrement(ident);
    }
}

/// (placed, dropped at capacity, hash conflicts, hashes left to wait)
pub type Placed = (usize, usize, usize, Vec<u64>);

/// `PyBlockStore._place_*`: with `idents` every block's content is given;
/// without, unknown blocks are left to wait and known ones placed.
pub(crate) fn place(
    cat: &mut Catalog,
    h: &mut impl Holder,
    seqs: &[u64],
    idents: Option<&[u64]>,
    room: i64,
) -> Result<Placed, Error> {
    let (mut placed, mut dropped, mut conflicts) = (0usize, 0usize, 0usize);
    let mut waits = Vec::new();
    for (k, &seq) in seqs.iter().enumerate() {
        if idents.is_none() && !cat.map.contains_key(&seq) {
            waits.push(seq);
            continue;
        }
        if !h.set().insert(seq) {
            continue;
        }
        if placed as i64 >= room {
            h.set().remove(&seq);
            // What is left is dropped, or waits when its content is unknown.
            for &rest in &seqs[k..] {
                if idents.is_some() || cat.map.contains_key(&rest) {
                    dropped += 1;
                } else {
                    waits.push(rest);
                }
            }
            break;
        }
        let ident = match idents {
            Some(given) => {
                let Some(&given) = given.get(k) else {
                    h.set().remove(&seq);
                    return Err(Error::FewerIdentities);
                };
                let ident = cat.acquire(seq, given);
                if ident != given {
                    conflicts += 1;
                }
                ident
            }
            // Known: the catalog's identity.
            None => cat.acquire(seq, 0),
        };
        h.count(seq, ident);
        placed += 1;
    }
    Ok((placed, dropped, conflicts, waits))
}

pub(crate) fn unplace(cat: &mut Catalog, h: &mut impl Holder, seq: u64) -> Result<bool, Error> {
    if !h.set().remove(&seq) {
        return Ok(false);
    }
    let ident = cat.release(seq)?;
    h.uncount(ident);
    Ok(true)
}

/// Takes every block out, in ascending hash order (the retired queue's
/// order must not depend on hash-set iteration).
pub(crate) fn clear(cat: &mut Catalog, h: &mut impl Holder) -> Result<usize, Error> {
    let mut seqs: Vec<u64> = h.set().iter().copied().collect();
    seqs.sort_unstable();
    for &seq in &seqs {
        unplace(cat, h, seq)?;
    }
    Ok(seqs.len())
}

/// A bulk load: placing block by block into an empty holder, unbounded.
pub(crate) fn load(
    cat: &mut Catalog,
    h: &mut impl Holder,
    empty: bool,
    seqs: &[u8],
    idents: &[u8],
    what: &'static str,
) -> Result<(), Error> {
    let (s, i) = (unpack(seqs)?, unpack(idents)?);
    if s.len() != i.len() {
        return Err(Error::CountsDiffer(what));
    }
    if !empty {
        return Err(Error::NotEmpty(what));
    }
    // Grown once, not by doubling through the load.
    cat.map.reserve(s.len());
    h.reserve(s.len());
    place(cat, h, &s, Some(&i), i64::MAX)?;
    Ok(())
}
