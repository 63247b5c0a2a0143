//! The engine payloads that real engines send (contract section 2), read
//! without Python: `[ts, [events], dp_rank]` with tagged map or array
//! `BlockStored` / `BlockRemoved` events, int hashes, token ids as ints.
//!
//! `kvconductor/wire/engine.py` stays the decoder of record: `decode` returns
//! None for anything outside this subset (other envelopes, digest hashes,
//! `AllBlocksCleared`, SGLang's salts and bigram tokens, a duplicate key,
//! trailing bytes, and every malformed payload), and the record then goes
//! through the Python decoder, which alone names errors. What `decode`
//! accepts it must read exactly as the Python decoder does
//! (tests/test_engine_lane.py compares them on every fixture and on
//! generated payloads).

/// Names longer than this (bytes) are left to the Python decoder, which
/// bounds them in characters (`records.MAX_NAME`).
const MAX_NAME: usize = 1024;
/// `engine_wire.MAX_GROUP_IDX`.
const MAX_GROUP_IDX: i128 = 1 << 16;
/// Nesting that `skip` follows; deeper values go to the Python decoder.
const MAX_DEPTH: u32 = 32;

/// `bytes` as a str when they are UTF-8; ASCII (every name engines send)
/// is told apart cheaply first.
fn utf8(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII is UTF-8.
        return Some(unsafe { std::str::from_utf8_unchecked(bytes) });
    }
    std::str::from_utf8(bytes).ok()
}

/// Whether two short byte strings of one length are equal, in word loads:
/// the field names are a few to 28 bytes, for which a `memcmp` call costs
/// more than the compare (it was ~4% of applying a record).
#[inline]
pub fn same(a: &[u8], b: &[u8]) -> bool {
    #[inline(always)]
    fn w8(s: &[u8], i: usize) -> u64 {
        u64::from_le_bytes(s[i..i + 8].try_into().unwrap_or_default())
    }
    #[inline(always)]
    fn w4(s: &[u8], i: usize) -> u32 {
        u32::from_le_bytes(s[i..i + 4].try_into().unwrap_or_default())
    }
    let n = a.len();
    if n != b.len() {
        return false;
    }
    match n {
        0 => true,
        // First, middle and last: every byte of up to three.
        1..=3 => a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1],
        4..=8 => w4(a, 0) == w4(b, 0) && w4(a, n - 4) == w4(b, n - 4),
        _ => {
            // Whole words, then the last (overlapping) word.
            let mut i = 0;
            while i + 8 < n {
                if w8(a, i) != w8(b, i) {
                    return false;
                }
                i += 8;
            }
            w8(a, n - 8) == w8(b, n - 8)
        }
    }
}

/// What an event's field is to the index.
#[derive(Clone, Copy)]
enum Field {
    Hashes,
    Parent,
    Tokens,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    Extra,
    GroupIdx,
    Kind,
    SlidingWindow,
    /// A `str | None` the index does not keep.
    IgnoredStr,
    /// A salt or SGLang's metadata: it changes the blocks' keys (Python's unless nil).
    Salted,
    /// The tag, read first (a second one is a repeated key).
    Type,
}

pub struct Batch<'a> {
    pub dp_rank: Option<u64>,
    pub events: Vec<Event<'a>>,
}

pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed(Removed<'a>),
}

/// `extra_keys` as far as the index tells them apart.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Extra {
    /// Absent or nil.
    None,
    /// A list of this many entries, each nil or empty (vLLM's plain text).
    Plain(usize),
    /// Some entry is a key the Python decoder fingerprints.
    Keyed,
}

pub struct Stored<'a> {
    pub hashes: Vec<u64>,
    pub parent: Option<u64>,
    /// Little-endian u32 token ids; None when absent, nil or empty.
    pub tokens: Option<Vec<u8>>,
    pub block_size: Option<i128>,
    pub lora_id: Option<i128>,
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub extra: Extra,
    pub group_idx: Option<u32>,
    pub kind: Option<&'a str>,
}

pub struct Removed<'a> {
    pub hashes: Vec<u64>,
    pub medium: Option<&'a str>,
    pub group_idx: Option<u32>,
}

/// The bytes a token id takes by its marker, for the encodings `tokens`
/// reads inline (fixint, uint8, uint16, uint32); 0: another.
const ID_LEN: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut m = 0;
    while m < 0x80 {
        t[m] = 1;
        m += 1;
    }
    t[0xcc] = 2;
    t[0xcd] = 3;
    t[0xce] = 5;
    t
};

/// How far the four bytes after a uint8, uint16 or uint32 marker shift
/// right to leave the id.
const ID_SHIFT: [u8; 256] = {
    let mut t = [0u8; 256];
    t[0xcc] = 24;
    t[0xcd] = 16;
    t
};

struct Rd<'a, 's> {
    b: &'a [u8],
    spare: &'s mut Spare,
}

/// The buffers of batches decoded before, for the next (`decode_with`): a
/// record's events then cost no allocation each.
#[derive(Default)]
pub struct Spare {
    hashes: Vec<Vec<u64>>,
    tokens: Vec<Vec<u8>>,
    events: Vec<Event<'static>>,
}

impl Spare {
    /// Takes back a batch's buffers.
    pub fn recycle(&mut self, batch: Batch<'_>) {
        let mut events = batch.events;
        for ev in events.drain(..) {
            match ev {
                Event::Stored(s) => {
                    self.hashes.push(s.hashes);
                    self.tokens.extend(s.tokens);
                }
                Event::Removed(r) => self.hashes.push(r.hashes),
            }
        }
        // Empty, so of any lifetime: collected in place, its allocation kept.
        self.events = events.into_iter().map(|_| unreachable!()).collect();
    }
}

impl<'a> Rd<'a, '_> {
    fn peek(&self) -> Option<u8> {
        self.b.first().copied()
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.b.len() {
            return None;
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Some(head)
    }

    fn byte(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }

    #[inline]
    fn be(&mut self, n: usize) -> Option<u64> {
        let b = self.take(n)?;
        // The widths msgpack uses as one load each, not a byte at a time.
        Some(match n {
            1 => u64::from(b[0]),
            2 => u64::from(u16::from_be_bytes([b[0], b[1]])),
            4 => u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])),
            8 => u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            _ => b.iter().fold(0u64, |v, &x| v << 8 | u64::from(x)),
        })
    }

    /// A length that each following element needs a byte of at least.
    fn bounded(&self, n: u64) -> Option<usize> {
        usize::try_from(n).ok().filter(|&n| n <= self.b.len())
    }

    fn nil(&mut self) -> bool {
        if self.peek() == Some(0xc0) {
            self.b = &self.b[1..];
            return true;
        }
        false
    }

    fn array_len(&mut self) -> Option<usize> {
        let n = match self.byte()? {
            m @ 0x90..=0x9f => u64::from(m & 0x0f),
            0xdc => self.be(2)?,
            0xdd => self.be(4)?,
            _ => return None,
        };
        self.bounded(n)
    }

    fn map_len(&mut self) -> Option<usize> {
        let n = match self.byte()? {
            m @ 0x80..=0x8f => u64::from(m & 0x0f),
            0xde => self.be(2)?,
            0xdf => self.be(4)?,
            _ => return None,
        };
        // A key and a value each.
        self.bounded(n.checked_mul(2)?).map(|_| n as usize)
    }

    fn int(&mut self) -> Option<i128> {
        let m = self.byte()?;
        Some(match m {
            0x00..=0x7f => i128::from(m),
            0xe0..=0xff => i128::from(m as i8),
            0xcc => i128::from(self.be(1)?),
            0xcd => i128::from(self.be(2)?),
            0xce => i128::from(self.be(4)?),
            0xcf => i128::from(self.be(8)?),
            0xd0 => i128::from(self.be(1)? as u8 as i8),
            0xd1 => i128::from(self.be(2)? as u16 as i16),
            0xd2 => i128::from(self.be(4)? as u32 as i32),
            0xd3 => i128::from(self.be(8)? as i64),
            _ => return None,
        })
    }

    /// A str's bytes, not yet checked to be UTF-8.
    fn str_bytes(&mut self) -> Option<&'a [u8]> {
        // A fixstr (every name engines write) in one bounds check.
        if let Some((&m, rest)) = self.b.split_first() {
            if m & 0xe0 == 0xa0 {
                let (s, rest) = rest.split_at_checked(usize::from(m & 0x1f))?;
                self.b = rest;
                return Some(s);
            }
        }
        let n = match self.byte()? {
            m @ 0xa0..=0xbf => u64::from(m & 0x1f),
            0xd9 => self.be(1)?,
            0xda => self.be(2)?,
            0xdb => self.be(4)?,
            _ => return None,
        };
        self.take(usize::try_from(n).ok()?)
    }

    fn str(&mut self) -> Option<&'a str> {
        utf8(self.str_bytes()?)
    }

    /// A map key: the index of its field in `fields` (known ASCII names,
    /// matched as bytes, from `next` on: engines write them in order), None
    /// for another name, which must still be a str for the Python decoder
    /// to take it (the outer None: it is not).
    #[inline]
    fn key(&mut self, fields: &[(&[u8], Field)], next: usize) -> Option<Option<usize>> {
        // Engines write the fields in order: the expected one is compared
        // in place first, as its fixstr's bytes (inline; the search apart).
        if let (Some(&(k, _)), Some((&m, rest))) = (fields.get(next), self.b.split_first()) {
            if k.len() < 32 && usize::from(m) == 0xa0 | k.len() && rest.get(..k.len()).is_some_and(|r| same(r, k)) {
                self.b = &rest[k.len()..];
                return Some(Some(next));
            }
        }
        self.search_key(fields, next)
    }

    #[inline(never)]
    fn search_key(&mut self, fields: &[(&[u8], Field)], next: usize) -> Option<Option<usize>> {
        let key = self.str_bytes()?;
        // Length and first byte tell every known name apart: one compare.
        let is = |(k, _): &(&[u8], Field)| k.len() == key.len() && k.first() == key.first() && same(k, key);
        let next = next.min(fields.len());
        let i = fields[next..].iter().position(is).map(|i| i + next).or_else(|| fields[..next].iter().position(is));
        if i.is_none() {
            utf8(key)?;
        }
        Some(i)
    }

    fn float(&mut self) -> Option<f64> {
        match self.byte()? {
            0xca => Some(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Some(f64::from_bits(self.be(8)?)),
            _ => None,
        }
    }

    /// Past one value of any type.
    fn skip(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        let m = self.byte()?;
        let (len, items) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(m & 0x0f)),
            0x90..=0x9f => (0, u64::from(m & 0x0f)),
            0xa0..=0xbf => (u64::from(m & 0x1f), 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 | 0xca => (4, 0),
            0xcf | 0xd3 | 0xcb => (8, 0),
            0xc4 | 0xd9 => (self.be(1)?, 0),
            0xc5 | 0xda => (self.be(2)?, 0),
            0xc6 | 0xdb => (self.be(4)?, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xc7 => (self.be(1)? + 1, 0),
            0xc8 => (self.be(2)? + 1, 0),
            0xc9 => (self.be(4)? + 1, 0),
            0xdc => (0, self.be(2)?),
            0xdd => (0, self.be(4)?),
            0xde => (0, 2 * self.be(2)?),
            0xdf => (0, 2 * self.be(4)?),
            _ => return None, // 0xc1: never used
        };
        self.take(usize::try_from(len).ok()?)?;
        for _ in 0..self.bounded(items)? {
            self.skip(depth + 1)?;
        }
        Some(())
    }

    fn opt<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<Option<T>> {
        if self.nil() {
            return Some(None);
        }
        read(self).map(Some)
    }

    /// A block hash: an int of either sign, as an unsigned u64 (digests are
    /// the Python decoder's).
    fn hash(&mut self) -> Option<u64> {
        // A uint64 or an int64 (the usual 64-bit hashes): its bits as they are.
        if let Some(&[0xcf | 0xd3, b1, b2, b3, b4, b5, b6, b7, b8]) = self.b.first_chunk::<9>() {
            self.b = &self.b[9..];
            return Some(u64::from_be_bytes([b1, b2, b3, b4, b5, b6, b7, b8]));
        }
        let v = self.int()?;
        if v < 0 {
            return Some(v as i64 as u64);
        }
        u64::try_from(v).ok()
    }

    fn hashes(&mut self) -> Option<Vec<u64>> {
        let n = self.array_len()?;
        let mut out = self.spare.hashes.pop().unwrap_or_default();
        out.clear();
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Some(out)
    }

    fn name(&mut self) -> Option<Option<&'a str>> {
        self.opt(|r| r.str().filter(|s| s.len() <= MAX_NAME))
    }

    /// `engine_wire._tokens`: an array of ids in [0, 2**32) packed, nil or
    /// empty as none; anything else (SGLang's bigram pairs, bad ids) is the
    /// Python decoder's.
    fn tokens(&mut self) -> Option<Option<Vec<u8>>> {
        if self.nil() {
            return Some(None);
        }
        let n = self.array_len()?;
        if n == 0 {
            return Some(None);
        }
        // Written in place, not pushed (a push of 4 bytes is a copy call
        // each) nor zeroed first (a `memset` call a store).
        let mut out = self.spare.tokens.pop().unwrap_or_default();
        out.clear();
        out.reserve(n * 4);
        let dst = out.spare_capacity_mut().as_mut_ptr().cast::<[u8; 4]>();
        let mut b = self.b;
        let mut k = 0;
        while k < n {
            // Four uint16 ids in one window: a vocabulary below 65,536 ids
            // writes nearly nothing else.
            while k + 4 <= n {
                let Some(w) = b.first_chunk::<12>() else { break };
                if w[0] != 0xcd || w[3] != 0xcd || w[6] != 0xcd || w[9] != 0xcd {
                    break;
                }
                for (j, at) in [1, 4, 7, 10].into_iter().enumerate() {
                    let v = u32::from(u16::from_be_bytes([w[at], w[at + 1]]));
                    // SAFETY: `k + j < n` and the buffer has room for `n` ids.
                    unsafe { dst.add(k + j).write_unaligned(v.to_le_bytes()) };
                }
                b = &b[12..];
                k += 4;
            }
            // Then up to four ids one at a time: the encodings of a
            // vocabulary's ids inline while a window as long as the longest
            // is in bounds, anything else (or near the end) the general way.
            let stop = n.min(k + 4);
            while k < stop {
                let v = match b.first_chunk::<5>() {
                    Some(&[m, b1, b2, b3, b4]) if ID_LEN[usize::from(m)] != 0 => {
                        b = &b[usize::from(ID_LEN[usize::from(m)])..];
                        // Branch-free: the four bytes after the marker,
                        // shifted to the width it gives, or the fixint itself.
                        let wide = u32::from_be_bytes([b1, b2, b3, b4]) >> ID_SHIFT[usize::from(m)];
                        if m < 0x80 {
                            u32::from(m)
                        } else {
                            wide
                        }
                    }
                    _ => super::msgpack_u32(&mut b)?,
                };
                // SAFETY: `k < n` and the buffer has room for `n` ids.
                unsafe { dst.add(k).write_unaligned(v.to_le_bytes()) };
                k += 1;
            }
        }
        // SAFETY: the loops wrote all `n` ids (they return early otherwise).
        unsafe { out.set_len(n * 4) };
        self.b = b;
        Some(Some(out))
    }

    fn extra(&mut self) -> Option<Extra> {
        if self.nil() {
            return Some(Extra::None);
        }
        let n = self.array_len()?;
        let mut plain = true;
        for _ in 0..n {
            match self.peek()? {
                0xc0 => self.b = &self.b[1..],
                0x90 => self.b = &self.b[1..], // an empty array
                _ => {
                    plain = false;
                    self.skip(1)?;
                }
            }
        }
        Some(if plain { Extra::Plain(n) } else { Extra::Keyed })
    }

    fn group_idx(&mut self) -> Option<Option<u32>> {
        self.opt(|r| r.int().filter(|g| (0..=MAX_GROUP_IDX).contains(g)).map(|g| g as u32))
    }

    /// A `str | None` field the index does not keep.
    fn ignored_str(&mut self) -> Option<()> {
        self.opt(Self::str).map(drop)
    }
}

fn new_stored<'a>() -> Stored<'a> {
    Stored {
        hashes: Vec::new(),
        parent: None,
        tokens: None,
        block_size: None,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra: Extra::None,
        group_idx: None,
        kind: None,
    }
}

/// One `BlockStored` field (inline: a call a field cost a register save
/// and restore each).
#[inline(always)]
fn stored_field<'a>(rd: &mut Rd<'a, '_>, ev: &mut Stored<'a>, field: Field) -> Option<()> {
    match field {
        Field::Hashes => ev.hashes = rd.hashes()?,
        Field::Parent => ev.parent = rd.opt(Rd::hash)?,
        Field::Tokens => ev.tokens = rd.tokens()?,
        Field::BlockSize => ev.block_size = rd.opt(Rd::int)?,
        Field::LoraId => ev.lora_id = rd.opt(Rd::int)?,
        Field::Medium => ev.medium = rd.name()?,
        Field::LoraName => ev.lora_name = rd.name()?,
        Field::Extra => ev.extra = rd.extra()?,
        Field::GroupIdx => ev.group_idx = rd.group_idx()?,
        Field::Kind => ev.kind = rd.opt(Rd::str)?,
        Field::SlidingWindow => drop(rd.opt(Rd::int)?),
        Field::IgnoredStr => rd.ignored_str()?,
        Field::Salted => {
            if !rd.nil() {
                return None;
            }
        }
        Field::Type => rd.skip(1)?,
    }
    Some(())
}

#[inline(always)]
fn removed_field<'a>(rd: &mut Rd<'a, '_>, ev: &mut Removed<'a>, field: Field) -> Option<()> {
    match field {
        Field::Hashes => ev.hashes = rd.hashes()?,
        Field::Medium => ev.medium = rd.name()?,
        Field::GroupIdx => ev.group_idx = rd.group_idx()?,
        Field::IgnoredStr => rd.ignored_str()?,
        _ => rd.skip(1)?,
    }
    Some(())
}

/// A known key of a map event (its index in the event's fields) seen once:
/// a repeated key is the Python decoder's.
fn once(seen: &mut u32, i: usize) -> Option<()> {
    let bit = 1u32 << i;
    if *seen & bit != 0 {
        return None;
    }
    *seen |= bit;
    Some(())
}

/// The map form's keys: first the array form's positions after the tag
/// (`engine_wire.ARRAY_FIELDS`: `*_POSITIONS` of them), then the map-only ones.
const STORED_FIELDS: &[(&[u8], Field)] = &[
    (b"block_hashes", Field::Hashes),
    (b"parent_block_hash", Field::Parent),
    (b"token_ids", Field::Tokens),
    (b"block_size", Field::BlockSize),
    (b"lora_id", Field::LoraId),
    (b"medium", Field::Medium),
    (b"lora_name", Field::LoraName),
    (b"extra_keys", Field::Extra),
    (b"group_idx", Field::GroupIdx),
    (b"kv_cache_spec_kind", Field::Kind),
    (b"kv_cache_spec_sliding_window", Field::SlidingWindow),
    (b"locality", Field::IgnoredStr),
    (b"ownership", Field::IgnoredStr),
    (b"session_id", Field::IgnoredStr),
    (b"cache_salt", Field::Salted),
    (b"metadata", Field::Salted),
    (b"type", Field::Type),
];
const STORED_POSITIONS: usize = 11;
const REMOVED_FIELDS: &[(&[u8], Field)] = &[
    (b"block_hashes", Field::Hashes),
    (b"medium", Field::Medium),
    (b"group_idx", Field::GroupIdx),
    (b"locality", Field::IgnoredStr),
    (b"ownership", Field::IgnoredStr),
    (b"type", Field::Type),
];
const REMOVED_POSITIONS: usize = 3;
/// The tag's index in both field lists.
const STORED_TYPE: usize = STORED_FIELDS.len() - 1;
const REMOVED_TYPE: usize = REMOVED_FIELDS.len() - 1;

/// A new store or removal at the end of `events`, filled there (an event is
/// a few hundred bytes: moved from a local, each was a copy call).
fn push_stored<'a, 'e>(events: &'e mut Vec<Event<'a>>) -> &'e mut Stored<'a> {
    events.push(Event::Stored(new_stored()));
    match events.last_mut() {
        Some(Event::Stored(s)) => s,
        _ => unreachable!("just pushed"),
    }
}

fn push_removed<'a, 'e>(events: &'e mut Vec<Event<'a>>) -> &'e mut Removed<'a> {
    events.push(Event::Removed(Removed { hashes: Vec::new(), medium: None, group_idx: None }));
    match events.last_mut() {
        Some(Event::Removed(r)) => r,
        _ => unreachable!("just pushed"),
    }
}

#[derive(Clone, Copy)]
enum Tag {
    Stored,
    Removed,
}

/// The event an engine tag names, compared in word loads (`same`).
fn tag(name: &[u8]) -> Option<Tag> {
    if same(name, b"BlockStored") {
        Some(Tag::Stored)
    } else if same(name, b"BlockRemoved") {
        Some(Tag::Removed)
    } else {
        None
    }
}

fn map_event<'a>(rd: &mut Rd<'a, '_>, events: &mut Vec<Event<'a>>) -> Option<()> {
    let n = rd.map_len()?;
    // The tag first: how every engine writes it.
    if n == 0 || !same(rd.str_bytes()?, b"type") {
        return None;
    }
    let mut seen = 0u32;
    // The hashes are the first field of both.
    match tag(rd.str_bytes()?) {
        Some(Tag::Stored) => {
            let ev = push_stored(events);
            once(&mut seen, STORED_TYPE)?;
            let mut next = 0;
            for _ in 1..n {
                match rd.key(STORED_FIELDS, next)? {
                    Some(i) => {
                        once(&mut seen, i)?;
                        next = i + 1;
                        stored_field(rd, ev, STORED_FIELDS[i].1)?;
                    }
                    None => rd.skip(1)?,
                }
            }
        }
        Some(Tag::Removed) => {
            let ev = push_removed(events);
            once(&mut seen, REMOVED_TYPE)?;
            let mut next = 0;
            for _ in 1..n {
                match rd.key(REMOVED_FIELDS, next)? {
                    Some(i) => {
                        once(&mut seen, i)?;
                        next = i + 1;
                        removed_field(rd, ev, REMOVED_FIELDS[i].1)?;
                    }
                    None => rd.skip(1)?,
                }
            }
        }
        _ => return None,
    }
    (seen & 1 != 0).then_some(())
}

fn array_event<'a>(rd: &mut Rd<'a, '_>, events: &mut Vec<Event<'a>>) -> Option<()> {
    let n = rd.array_len()?;
    if n < 2 {
        return None; // no hashes, or AllBlocksCleared
    }
    match tag(rd.str_bytes()?) {
        Some(Tag::Stored) if n <= 1 + STORED_POSITIONS => {
            let ev = push_stored(events);
            for &(_, field) in &STORED_FIELDS[..n - 1] {
                // Index 7 may be SGLang's metadata map: the Python decoder's.
                stored_field(rd, ev, field)?;
            }
            Some(())
        }
        Some(Tag::Removed) if n <= 1 + REMOVED_POSITIONS => {
            let ev = push_removed(events);
            for &(_, field) in &REMOVED_FIELDS[..n - 1] {
                removed_field(rd, ev, field)?;
            }
            Some(())
        }
        _ => None,
    }
}

/// The payload, when it is in the subset this module reads (see the module doc).
#[cfg(test)]
pub fn decode(payload: &[u8]) -> Option<Batch<'_>> {
    decode_with(payload, &mut Spare::default())
}

/// `decode`, in buffers taken from `spare` (given back by `Spare::recycle`).
pub fn decode_with<'a>(payload: &'a [u8], spare: &mut Spare) -> Option<Batch<'a>> {
    let mut events = std::mem::take(&mut spare.events).into_iter().map(|_| unreachable!()).collect::<Vec<Event<'a>>>();
    let mut rd = Rd { b: payload, spare };
    let len = rd.array_len()?;
    if !(2..=3).contains(&len) {
        return None;
    }
    rd.float()?;
    let n = rd.array_len()?;
    events.reserve(n);
    for _ in 0..n {
        match rd.peek()? {
            0x80..=0x8f | 0xde | 0xdf => map_event(&mut rd, &mut events)?,
            0x90..=0x9f | 0xdc | 0xdd => array_event(&mut rd, &mut events)?,
            _ => return None,
        }
    }
    let dp_rank = if len == 3 { rd.opt(|r| u64::try_from(r.int()?).ok())? } else { None };
    rd.b.is_empty().then_some(Batch { dp_rank, events })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn str_(out: &mut Vec<u8>, s: &str) {
        assert!(s.len() < 32);
        out.push(0xa0 | s.len() as u8);
        out.extend_from_slice(s.as_bytes());
    }

    fn stored_map(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Vec<u8> {
        let mut e = vec![0x84];
        str_(&mut e, "type");
        str_(&mut e, "BlockStored");
        str_(&mut e, "block_hashes");
        e.push(0x90 | hashes.len() as u8);
        for &h in hashes {
            e.push(0xcf);
            e.extend_from_slice(&h.to_be_bytes());
        }
        str_(&mut e, "parent_block_hash");
        match parent {
            None => e.push(0xc0),
            Some(p) => {
                e.push(0xcf);
                e.extend_from_slice(&p.to_be_bytes());
            }
        }
        str_(&mut e, "token_ids");
        e.push(0xdc);
        e.extend_from_slice(&(tokens.len() as u16).to_be_bytes());
        for &t in tokens {
            e.push(0xce);
            e.extend_from_slice(&t.to_be_bytes());
        }
        e
    }

    fn batch(events: &[Vec<u8>], rank: Option<u8>) -> Vec<u8> {
        let mut b = vec![if rank.is_some() { 0x93 } else { 0x92 }, 0xcb];
        b.extend_from_slice(&1.5f64.to_bits().to_be_bytes());
        b.push(0x90 | events.len() as u8);
        for e in events {
            b.extend_from_slice(e);
        }
        if let Some(r) = rank {
            b.push(r);
        }
        b
    }

    #[test]
    fn reads_a_map_form_store() {
        let p = batch(&[stored_map(&[7, u64::MAX], Some(3), &[1, 2, 70000, 4])], Some(2));
        let b = decode(&p).expect("in the subset");
        assert_eq!(b.dp_rank, Some(2));
        let Event::Stored(s) = &b.events[0] else { panic!("a store") };
        assert_eq!(s.hashes, vec![7, u64::MAX]);
        assert_eq!(s.parent, Some(3));
        let t = s.tokens.as_ref().expect("tokens");
        assert_eq!(t.len(), 16);
        assert_eq!(&t[8..12], &70000u32.to_le_bytes());
    }

    #[test]
    fn leaves_the_rest_to_python() {
        let good = batch(&[stored_map(&[7], None, &[1])], None);
        assert!(decode(&good).is_some());
        let mut trailing = good.clone();
        trailing.push(0xc0);
        assert!(decode(&trailing).is_none());
        assert!(decode(&good[..good.len() - 1]).is_none());
        // A repeated key.
        let mut e = stored_map(&[7], None, &[1]);
        e[0] = 0x85;
        str_(&mut e, "parent_block_hash");
        e.push(0xc0);
        assert!(decode(&batch(&[e], None)).is_none());
        // An int ts, a negative rank, AllBlocksCleared.
        let mut int_ts = good.clone();
        int_ts[1] = 0x01;
        int_ts.drain(2..10);
        assert!(decode(&int_ts).is_none());
        let mut neg = batch(&[stored_map(&[7], None, &[1])], Some(0));
        *neg.last_mut().unwrap() = 0xff;
        assert!(decode(&neg).is_none());
        let mut cleared = vec![0x91];
        str_(&mut cleared, "AllBlocksCleared");
        assert!(decode(&batch(&[cleared], None)).is_none());
    }

    #[test]
    fn reads_negative_hashes_as_unsigned() {
        let mut e = vec![0x92];
        str_(&mut e, "BlockRemoved");
        e.extend_from_slice(&[0x92, 0xff, 0xd3]);
        e.extend_from_slice(&(-2i64).to_be_bytes());
        let payload = batch(&[e], None);
        let b = decode(&payload).expect("in the subset");
        let Event::Removed(r) = &b.events[0] else { panic!("a removal") };
        assert_eq!(r.hashes, vec![u64::MAX, u64::MAX - 1]);
    }

    #[test]
    fn reads_runs_of_uint16_ids_mixed_with_others() {
        // Sequences mostly of uint16 ids, with other encodings anywhere in
        // them (the four-at-a-time window must start and stop everywhere).
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in 0..40usize {
            for _ in 0..20 {
                let mut enc = Vec::new();
                let mut want = Vec::new();
                for _ in 0..len {
                    let r = next();
                    let v = match r % 8 {
                        0 => (r >> 8) as u32 & 0x7f,
                        1 => 0x80 | ((r >> 8) as u32 & 0x7f),
                        2 => (r >> 8) as u32 | 0x1_0000,
                        _ => 0x100 + ((r >> 8) as u32 % 0xff00),
                    };
                    match v {
                        0..=0x7f => enc.push(v as u8),
                        0x80..=0xff => enc.extend_from_slice(&[0xcc, v as u8]),
                        0x100..=0xffff => {
                            enc.push(0xcd);
                            enc.extend_from_slice(&(v as u16).to_be_bytes());
                        }
                        _ => {
                            enc.push(0xce);
                            enc.extend_from_slice(&v.to_be_bytes());
                        }
                    }
                    want.extend_from_slice(&v.to_le_bytes());
                }
                let e = stored_with_tokens(&[0xdc, 0, len as u8], &enc);
                // With and without bytes after the ids (the rank).
                for rank in [None, Some(3)] {
                    let p = batch(std::slice::from_ref(&e), rank);
                    let b = decode(&p).expect("in the subset");
                    let Event::Stored(s) = &b.events[0] else { panic!("a store") };
                    assert_eq!(s.tokens.as_deref().unwrap_or_default(), &want[..]);
                }
                if !enc.is_empty() {
                    let p = batch(std::slice::from_ref(&e), None);
                    assert!(decode(&p[..p.len() - 1]).is_none());
                }
            }
        }
    }

    /// A `BlockStored` of block hash 7 whose `token_ids` are the array
    /// header `head` then the encoded ids `ids`.
    fn stored_with_tokens(head: &[u8], ids: &[u8]) -> Vec<u8> {
        let mut e = vec![0x83];
        str_(&mut e, "type");
        str_(&mut e, "BlockStored");
        str_(&mut e, "block_hashes");
        e.extend_from_slice(&[0x91, 0x07]);
        str_(&mut e, "token_ids");
        e.extend_from_slice(head);
        e.extend_from_slice(ids);
        e
    }

    #[test]
    fn reads_hashes_and_keys_in_any_encoding() {
        // Hashes as uint64, a positive int64, uint8 and a fixint; the key
        // as a str8 and the removal's fields out of order.
        let mut e = vec![0x83];
        str_(&mut e, "type");
        str_(&mut e, "BlockRemoved");
        e.extend_from_slice(&[0xd9, 6]);
        e.extend_from_slice(b"medium");
        str_(&mut e, "GPU");
        str_(&mut e, "block_hashes");
        e.extend_from_slice(&[0x94, 0xcf]);
        e.extend_from_slice(&u64::MAX.to_be_bytes());
        e.push(0xd3);
        e.extend_from_slice(&5i64.to_be_bytes());
        e.extend_from_slice(&[0xcc, 200, 0x07]);
        let payload = batch(&[e], None);
        let b = decode(&payload).expect("in the subset");
        let Event::Removed(r) = &b.events[0] else { panic!("a removal") };
        assert_eq!(r.hashes, vec![u64::MAX, 5, 200, 7]);
        assert_eq!(r.medium, Some("GPU"));
        for cut in 1..12 {
            assert!(decode(&payload[..payload.len() - cut]).is_none());
        }
    }

    #[test]
    fn same_compares_every_length() {
        let names: Vec<Vec<u8>> = (0..40).map(|n| (0..n).map(|i| b'a' + (i % 26) as u8).collect()).collect();
        for a in &names {
            for b in &names {
                assert_eq!(same(a, b), a == b);
            }
            // One byte changed anywhere.
            for i in 0..a.len() {
                let mut c = a.clone();
                c[i] ^= 1;
                assert!(!same(a, &c), "{a:?} at {i}");
            }
        }
    }

    #[test]
    fn reads_every_token_encoding_up_to_the_payload_end() {
        // Fixint, uint8, uint16, uint32, int8/int16 (positive) and int64,
        // last in the payload so that the final ones have no five-byte window.
        let ids: [(u32, &[u8]); 8] = [
            (5, &[0x05]),
            (200, &[0xcc, 200]),
            (40_000, &[0xcd, 0x9c, 0x40]),
            (70_000, &[0xce, 0x00, 0x01, 0x11, 0x70]),
            (7, &[0xd0, 0x07]),
            (300, &[0xd1, 0x01, 0x2c]),
            (9, &[0xd3, 0, 0, 0, 0, 0, 0, 0, 9]),
            (u32::MAX, &[0xce, 0xff, 0xff, 0xff, 0xff]),
        ];
        for rot in 0..ids.len() {
            let order: Vec<_> = ids.iter().cycle().skip(rot).take(ids.len()).collect();
            let enc: Vec<u8> = order.iter().flat_map(|(_, enc)| enc.iter().copied()).collect();
            let e = stored_with_tokens(&[0x90 | order.len() as u8], &enc);
            let p = batch(&[e], None);
            let b = decode(&p).expect("in the subset");
            let Event::Stored(s) = &b.events[0] else { panic!("a store") };
            let want: Vec<u8> = order.iter().flat_map(|(v, _)| v.to_le_bytes()).collect();
            assert_eq!(s.tokens.as_deref(), Some(&want[..]));
            // Cut short anywhere in the ids: not in the subset.
            for cut in 1..order.iter().map(|(_, enc)| enc.len()).sum::<usize>() {
                assert!(decode(&p[..p.len() - cut]).is_none());
            }
        }
    }

    #[test]
    fn skips_nested_unknown_values() {
        let mut e = stored_map(&[7], None, &[1]);
        e[0] = 0x85;
        str_(&mut e, "future");
        e.extend_from_slice(&[0x82, 0xa1, b'a', 0x91, 0xc3, 0xa1, b'b', 0xc7, 0x01, 0x05, 0x00]);
        assert!(decode(&batch(&[e], None)).is_some());
    }
}
