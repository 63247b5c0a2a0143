//! The query's walk (`PyBlockStore._match`): a prompt's blocks against the
//! owners' masks and the pools' counts, tier by tier, a chunk of blocks at
//! a time with every probe of the chunk prefetched first.

use std::convert::Infallible;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{Error, Store, DEVICE, DISK, HOST};
use crate::maps::CountMap;

/// An owner slot's blocks matched on GPU, CPU and DISK.
pub type Matched = (usize, u32, u32, u32);

/// Where a prompt's identities come from, one block at a time.
pub trait Source {
    type Error;
    /// Block `i`'s identity (blocks are asked for in order), or None when
    /// every identity was given up front.
    fn ident(&mut self, i: usize) -> Result<Option<u64>, Self::Error>;
}

/// Little-endian u32 tokens, `step` bytes a block, chained from `ident`.
pub struct Tokens<'a> {
    data: &'a [u8],
    step: usize,
    ident: u64,
}

impl Source for Tokens<'_> {
    type Error = Infallible;
    #[inline]
    fn ident(&mut self, i: usize) -> Result<Option<u64>, Infallible> {
        self.ident = xxh3_64_with_seed(&self.data[i * self.step..(i + 1) * self.step], self.ident);
        Ok(Some(self.ident))
    }
}

/// Everything extracted up front (the prompt's `idents` is full).
pub struct Given;

impl Source for Given {
    type Error = Infallible;
    fn ident(&mut self, _: usize) -> Result<Option<u64>, Infallible> {
        Ok(None)
    }
}

/// The prompt's identities, computed a chunk at a time as far as the walk
/// reads them.
pub struct Prompt<S> {
    source: S,
    idents: Vec<u64>,
    len: usize,
}

impl<S> Prompt<S> {
    /// `len` blocks from `source`.
    pub fn new(source: S, len: usize) -> Self {
        Prompt { source, idents: Vec::with_capacity(len), len }
    }
}

impl<'a> Prompt<Tokens<'a>> {
    /// Packed u32 tokens hashed block by block from `seed` (a trailing
    /// partial block is not a block).
    pub fn tokens(data: &'a [u8], block_size: usize, seed: u64) -> Result<Self, Error> {
        let step = block_size.checked_mul(4).filter(|s| *s > 0).ok_or(Error::BlockSize)?;
        Ok(Prompt::new(Tokens { data, step, ident: seed }, data.len() / step))
    }
}

impl Prompt<Given> {
    pub fn given(idents: Vec<u64>) -> Self {
        Prompt { source: Given, len: idents.len(), idents }
    }
}

impl<S: Source> Prompt<S> {
    /// The identities of blocks `from..`, up to `GATHER` of them (none past
    /// the prompt's end), computed as far as they are read.
    fn chunk(&mut self, from: usize) -> Result<&[u64], S::Error> {
        let to = (from + GATHER).min(self.len);
        while self.idents.len() < to {
            let i = self.idents.len();
            let Some(id) = self.source.ident(i)? else { break };
            self.idents.push(id);
        }
        Ok(&self.idents[from.min(to)..to])
    }
}

/// Blocks whose map probes a walk issues together: each probe of a large
/// index is a likely cache miss, and independent probes overlap them (at
/// four million entries a serial walk spent most of its time waiting on
/// memory). A chunk past a prefix's end costs a few wasted probes.
pub const GATHER: usize = 16;

/// The blocks each of a word's slots matched, per tier (GPU, CPU, DISK).
type Ends = [[u32; 64]; 3];

fn ended(mut bits: u64, at: usize, into: &mut [u32; 64]) {
    while bits != 0 {
        into[bits.trailing_zeros() as usize] = at as u32;
        bits &= bits - 1;
    }
}

fn probe(m: Option<&CountMap>, id: u64) -> u64 {
    m.map_or(0, |m| m.get(id))
}

fn pooled(m: Option<&CountMap>, id: u64) -> bool {
    m.is_some_and(|m| m.contains(id))
}

fn prefetch(m: Option<&CountMap>, id: u64) {
    if let Some(m) = m {
        m.prefetch(id);
    }
}

impl Store {
    /// The walk of `PyBlockStore._match`: the listed 64-slot words walk the
    /// prompt together, a chunk of blocks at a time, so that every word's
    /// probes of a chunk are in flight at once (see `GATHER`).
    pub fn matched<S: Source>(&self, prompt: &mut Prompt<S>, listed: &[u64]) -> Result<Vec<Matched>, S::Error> {
        let pool_host = Some(&self.pool_counts[HOST]).filter(|m| !m.is_empty());
        let pool_disk = Some(&self.pool_counts[DISK]).filter(|m| !m.is_empty());
        let mut words: Vec<Word<'_>> = listed
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, l)| l != 0)
            .map(|(w, l)| Word {
                w,
                listed: l,
                dev: self.word_masks(DEVICE, w),
                host: self.word_masks(HOST, w),
                disk: self.word_masks(DISK, w),
                g: l,
                c: l,
                d: l,
                ends: [[0; 64]; 3],
                got: [(0, 0); GATHER],
            })
            .collect();
        let mut i = 0;
        loop {
            let ids = prompt.chunk(i)?;
            if ids.is_empty() || words.iter().all(|w| w.d == 0) {
                break;
            }
            for word in words.iter().filter(|w| w.d != 0) {
                for &id in ids {
                    prefetch(word.dev, id);
                }
            }
            // A prefix that pools extend keeps every owner needing the
            // pool's answer, block after block, in every word; where a
            // host pool serves a block, no owner's host tier can add to
            // it, so those blocks' host probes are not made (at 4.3M
            // entries they were a third of the probes of a long hit).
            for &id in ids {
                prefetch(pool_host, id);
            }
            let mut in_pool = [false; GATHER];
            for (p, &id) in in_pool.iter_mut().zip(ids) {
                *p = pooled(pool_host, id);
            }
            for word in words.iter().filter(|w| w.d != 0) {
                for (&p, &id) in in_pool.iter().zip(ids) {
                    if !p {
                        prefetch(word.host, id);
                    }
                }
            }
            for word in words.iter_mut().filter(|w| w.d != 0) {
                for ((m, &p), &id) in word.got.iter_mut().zip(&in_pool).zip(ids) {
                    *m = (probe(word.dev, id), if p { 0 } else { probe(word.host, id) });
                }
                word.step(ids, i, &in_pool, pool_disk);
            }
            i += ids.len();
        }
        let mut out = Vec::with_capacity(words.iter().map(|w| w.listed.count_ones() as usize).sum());
        for word in &mut words {
            let (g, c, d) = (word.g, word.c, word.d);
            ended(g, i, &mut word.ends[0]);
            ended(c, i, &mut word.ends[1]);
            ended(d, i, &mut word.ends[2]);
            let mut bits = word.listed;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                let e = &word.ends;
                out.push((word.w * 64 + b, e[0][b], e[1][b], e[2][b]));
                bits &= bits - 1;
            }
        }
        Ok(out)
    }

    fn word_masks(&self, tier: usize, w: usize) -> Option<&CountMap> {
        self.masks[tier].get(w).filter(|m| !m.is_empty())
    }
}

/// One 64-slot word's walk: its maps and its still-matching owners of each
/// tier as bits (g ⊆ c ⊆ d).
struct Word<'a> {
    w: usize,
    listed: u64,
    dev: Option<&'a CountMap>,
    host: Option<&'a CountMap>,
    disk: Option<&'a CountMap>,
    g: u64,
    c: u64,
    d: u64,
    ends: Ends,
    /// The chunk's (device, own host) masks, gathered.
    got: [(u64, u64); GATHER],
}

impl Word<'_> {
    /// Blocks `at..` (`ids`), their device and host masks in `got` (host 0
    /// where a host pool holds the block: `in_pool`). The rarer probes are
    /// made only where they can change an outcome: disk for owners off
    /// both, the disk pool only where the owner maps leave some owner
    /// unserved. With device tiers only, CPU and DISK equal GPU.
    fn step(&mut self, ids: &[u64], at: usize, in_pool: &[bool; GATHER], pool_disk: Option<&CountMap>) {
        let (mut g, mut c, mut d) = (self.g, self.c, self.d);
        for (j, ((&(dm, h), &id), &p)) in self.got.iter().zip(ids).zip(in_pool).enumerate() {
            let ng = g & dm;
            // Owners that need a lower tier for this block.
            let need = d & !ng;
            let (nc, nd) = if need == 0 || p || need & !h == 0 {
                (c, d)
            } else {
                let k = h | probe(self.disk, id);
                let nd = if need & !k == 0 || pooled(pool_disk, id) { d } else { ng | (d & k) };
                (ng | (c & h), nd)
            };
            if ng != g {
                ended(g ^ ng, at + j, &mut self.ends[0]);
                g = ng;
            }
            if nc != c {
                ended(c ^ nc, at + j, &mut self.ends[1]);
                c = nc;
            }
            if nd != d {
                ended(d ^ nd, at + j, &mut self.ends[2]);
                d = nd;
                if d == 0 {
                    break;
                }
            }
        }
        (self.g, self.c, self.d) = (g, c, d);
    }
}
