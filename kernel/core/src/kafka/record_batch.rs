//! Kafka's record batches (magic 2, `DefaultRecordBatch` in Apache Kafka)
//! read straight from a fetch response's partition `records` bytes into the
//! `core.Incoming`s the consumer applies (`consumers/fetcher.py`), with no
//! Python per record.
//!
//! A partition's bytes are a sequence of batches, the last of which the
//! broker may have cut short at the fetch size: a partial trailing batch is
//! ignored (the next fetch starts at it). Each batch's CRC-32C, over its
//! attributes to its end, is checked: with SSE 4.2 it costs well under a
//! tenth of a microsecond a record. Control batches are skipped, and with
//! `read_committed` the batches of aborted transactions too, from the
//! fetch answer's aborted transactions, as Kafka's consumers do.
//!
//! A compressed batch's records are decompressed by the caller (`Inflate`):
//! the Python edge hands them to the codecs aiokafka already uses, once a
//! batch, so the kernel needs no compression crates and the framings
//! (xerial snappy, lz4 frames) stay those aiokafka reads.
//!
//! Plain Rust: the Python edge is `kernel/py/src/record_batch.rs`.

use std::borrow::Cow;
use std::collections::BinaryHeap;

use hashbrown::HashSet;

use super::crc::crc32c;

/// Bytes of a batch before its records.
pub const BATCH_HEADER: usize = 61;
/// baseOffset (8) and batchLength (4): what precedes the length's bytes.
const LOG_OVERHEAD: usize = 12;
/// Where the CRC-checked part starts (the attributes).
const CRC_FROM: usize = 21;

const CODEC_MASK: i16 = 0x07;
const LOG_APPEND_TIME: i16 = 0x08;
const TRANSACTIONAL: i16 = 0x10;
const CONTROL: i16 = 0x20;

/// What is wrong with a partition's bytes, at which batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A batch that does not parse.
    Corrupt { base_offset: i64, what: &'static str },
    /// A batch whose CRC-32C does not match its bytes.
    Crc { base_offset: i64 },
    /// A batch of the older message formats (magic 0 or 1).
    Magic { base_offset: i64, magic: i8 },
    /// The caller could not decompress a batch.
    Inflate { base_offset: i64, reason: String },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Corrupt { base_offset, what } => write!(f, "corrupt record batch at offset {base_offset}: {what}"),
            Error::Crc { base_offset } => write!(f, "record batch at offset {base_offset} fails its CRC-32C"),
            Error::Magic { base_offset, magic } => {
                write!(f, "record batch at offset {base_offset} has magic {magic}: only magic 2 is read")
            }
            Error::Inflate { base_offset, reason } => {
                write!(f, "record batch at offset {base_offset} does not decompress: {reason}")
            }
        }
    }
}

fn be_i16(b: &[u8], at: usize) -> i16 {
    i16::from_be_bytes([b[at], b[at + 1]])
}

fn be_i32(b: &[u8], at: usize) -> i32 {
    i32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be_i64(b: &[u8], at: usize) -> i64 {
    i64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// One batch's header, its records' bytes as stored (compressed when
/// `codec() != 0`).
#[derive(Debug, Clone)]
pub struct Batch<'a> {
    pub base_offset: i64,
    pub last_offset_delta: i32,
    pub first_timestamp: i64,
    pub max_timestamp: i64,
    pub producer_id: i64,
    pub attributes: i16,
    pub count: i32,
    pub body: &'a [u8],
}

impl Batch<'_> {
    pub fn codec(&self) -> u8 {
        (self.attributes & CODEC_MASK) as u8
    }

    pub fn transactional(&self) -> bool {
        self.attributes & TRANSACTIONAL != 0
    }

    pub fn control(&self) -> bool {
        self.attributes & CONTROL != 0
    }

    /// The offset after the batch's last, kept even when compaction
    /// removed its last records.
    pub fn next_offset(&self) -> i64 {
        self.base_offset + i64::from(self.last_offset_delta) + 1
    }

    fn corrupt(&self, what: &'static str) -> Error {
        Error::Corrupt { base_offset: self.base_offset, what }
    }
}

/// The complete batches of a partition's bytes, in order; a partial
/// trailing batch ends them.
pub struct Batches<'a> {
    data: &'a [u8],
    check_crc: bool,
}

impl<'a> Batches<'a> {
    pub fn new(data: &'a [u8], check_crc: bool) -> Self {
        Batches { data, check_crc }
    }

    fn parse(&mut self) -> Option<Result<Batch<'a>, Error>> {
        let data = self.data;
        if data.len() < LOG_OVERHEAD {
            return None;
        }
        let base_offset = be_i64(data, 0);
        let Ok(length) = usize::try_from(be_i32(data, 8)) else {
            return Some(Err(Error::Corrupt { base_offset, what: "negative batch length" }));
        };
        let Some(size) = length.checked_add(LOG_OVERHEAD) else {
            return Some(Err(Error::Corrupt { base_offset, what: "batch length overflows" }));
        };
        if data.len() < size {
            return None; // cut short at the fetch size
        }
        let bytes = &data[..size];
        // The magic byte sits at the same place in every format.
        if size > 16 && bytes[16] as i8 != 2 {
            return Some(Err(Error::Magic { base_offset, magic: bytes[16] as i8 }));
        }
        if size < BATCH_HEADER {
            return Some(Err(Error::Corrupt { base_offset, what: "batch shorter than its header" }));
        }
        self.data = &data[size..];
        let crc = u32::from_be_bytes(bytes[17..21].try_into().expect("4 bytes"));
        if self.check_crc && crc32c(&bytes[CRC_FROM..]) != crc {
            return Some(Err(Error::Crc { base_offset }));
        }
        Some(Ok(Batch {
            base_offset,
            attributes: be_i16(bytes, 21),
            last_offset_delta: be_i32(bytes, 23),
            first_timestamp: be_i64(bytes, 27),
            max_timestamp: be_i64(bytes, 35),
            producer_id: be_i64(bytes, 43),
            count: be_i32(bytes, 57),
            body: &bytes[BATCH_HEADER..],
        }))
    }
}

impl<'a> Iterator for Batches<'a> {
    type Item = Result<Batch<'a>, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        let out = self.parse();
        if matches!(out, Some(Err(_))) {
            self.data = &[]; // nothing after a bad batch can be trusted
        }
        out
    }
}

/// One header of a record: its key (UTF-8 by the protocol, not checked
/// here) and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header<'a> {
    pub key: &'a [u8],
    pub value: Option<&'a [u8]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    pub offset: i64,
    pub timestamp: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
}

/// A cursor over a record's bytes.
struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn varlong(&mut self) -> Option<i64> {
        let mut raw: u64 = 0;
        for (i, &byte) in self.b.iter().enumerate().take(10) {
            raw |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                self.b = &self.b[i + 1..];
                return Some((raw >> 1) as i64 ^ -((raw & 1) as i64));
            }
        }
        None
    }

    fn varint(&mut self) -> Option<i32> {
        i32::try_from(self.varlong()?).ok()
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.b.len() {
            return None;
        }
        let (out, rest) = self.b.split_at(n);
        self.b = rest;
        Some(out)
    }

    /// A length-prefixed field: -1 is null.
    fn field(&mut self) -> Option<Option<&'a [u8]>> {
        match self.varint()? {
            -1 => Some(None),
            n => Some(Some(self.take(usize::try_from(n).ok()?)?)),
        }
    }
}

/// Calls `f` with each record of `batch` whose records' bytes are `body`
/// (decompressed), and its headers. A record that does not parse ends the
/// batch with an error; the records before it were given to `f`.
pub fn for_each_record<'b, E>(
    batch: &Batch<'_>,
    body: &'b [u8],
    headers: &mut Vec<Header<'b>>,
    mut f: impl FnMut(&Record<'b>, &[Header<'b>]) -> Result<(), E>,
) -> Result<Result<(), E>, Error> {
    let mut cur = Cursor { b: body };
    let append_time = batch.attributes & LOG_APPEND_TIME != 0;
    for _ in 0..batch.count.max(0) {
        let Some(len) = cur.varint().and_then(|n| usize::try_from(n).ok()) else {
            return Err(batch.corrupt("bad record length"));
        };
        let Some(bytes) = cur.take(len) else { return Err(batch.corrupt("record past the batch's end")) };
        let mut rec = Cursor { b: bytes };
        let parsed = (|| {
            rec.take(1)?; // attributes: none defined
            let ts_delta = rec.varlong()?;
            let offset_delta = rec.varint()?;
            let key = rec.field()?;
            let value = rec.field()?;
            let n = usize::try_from(rec.varint()?).ok()?;
            headers.clear();
            for _ in 0..n {
                let key = rec.field()??;
                let value = rec.field()?;
                headers.push(Header { key, value });
            }
            let timestamp =
                if append_time { batch.max_timestamp } else { batch.first_timestamp.wrapping_add(ts_delta) };
            let offset = batch.base_offset.wrapping_add(i64::from(offset_delta));
            Some(Record { offset, timestamp, key, value })
        })();
        let Some(record) = parsed else { return Err(batch.corrupt("record does not parse")) };
        if let Err(e) = f(&record, headers) {
            return Ok(Err(e));
        }
    }
    Ok(Ok(()))
}

/// A control batch's marker: true for an abort (its one record's key is
/// version, type; type 0 aborts, 1 commits).
fn is_abort_marker(batch: &Batch<'_>, body: &[u8]) -> Result<bool, Error> {
    let mut headers = Vec::new();
    let mut abort = None;
    let _ = for_each_record(batch, body, &mut headers, |r, _| {
        abort = r.key.filter(|k| k.len() >= 4).map(|k| be_i16(k, 2) == 0);
        Err(()) // the first record says it
    })?;
    abort.ok_or_else(|| batch.corrupt("control batch without a marker"))
}

/// Decompresses a batch's records (`codec` 1 gzip, 2 snappy, 3 lz4, 4 zstd).
pub trait Inflate {
    fn inflate(&mut self, codec: u8, data: &[u8]) -> Result<Vec<u8>, String>;
}

/// What reading one partition's bytes gave: the offset to fetch next, and
/// the error that stopped it early, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub next_offset: i64,
    pub error: Option<Error>,
}

/// Reads a partition's fetched bytes from `fetch_offset` on, as Kafka's
/// consumers do: records below `fetch_offset` (earlier records of a
/// compressed batch) are skipped, control batches too, and with
/// `read_committed` the batches of the `aborted` transactions (producer
/// id, first offset). `f` gets each record to deliver; the records before
/// an error were given to it, and `next_offset` is past them.
pub fn read_partition<E>(
    data: &[u8],
    fetch_offset: i64,
    aborted: &[(i64, i64)],
    read_committed: bool,
    check_crc: bool,
    inflate: &mut dyn Inflate,
    mut f: impl FnMut(&Record<'_>, &[Header<'_>]) -> Result<(), E>,
) -> Result<Read, E> {
    let mut aborted: Vec<(i64, i64)> = aborted.to_vec();
    aborted.sort_by_key(|&(_, first)| std::cmp::Reverse(first)); // popped from the end
    let mut aborting: HashSet<i64> = HashSet::new();
    let mut next_offset = fetch_offset;
    let mut error = None;
    for batch in Batches::new(data, check_crc) {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                error = Some(e);
                break;
            }
        };
        let body: Cow<'_, [u8]> = match batch.codec() {
            0 => Cow::Borrowed(batch.body),
            codec => match inflate.inflate(codec, batch.body) {
                Ok(v) => Cow::Owned(v),
                Err(reason) => {
                    error = Some(Error::Inflate { base_offset: batch.base_offset, reason });
                    break;
                }
            },
        };
        if read_committed && batch.producer_id >= 0 {
            while let Some(&(pid, first)) = aborted.last() {
                if first > batch.base_offset {
                    break;
                }
                aborting.insert(pid);
                aborted.pop();
            }
            if batch.control() {
                match is_abort_marker(&batch, &body) {
                    Ok(true) => {
                        // An abort marker may come for an otherwise empty partition.
                        aborting.remove(&batch.producer_id);
                    }
                    Ok(false) => {}
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
            if batch.transactional() && aborting.contains(&batch.producer_id) {
                next_offset = next_offset.max(batch.next_offset());
                continue;
            }
        }
        if batch.control() {
            next_offset = next_offset.max(batch.next_offset());
            continue;
        }
        let mut headers = Vec::new();
        let outcome = for_each_record(&batch, &body, &mut headers, |r, h| {
            if r.offset < next_offset {
                return Ok(());
            }
            f(r, h)?;
            next_offset = r.offset + 1;
            Ok(())
        });
        match outcome {
            Ok(Ok(())) => next_offset = next_offset.max(batch.next_offset()),
            Ok(Err(e)) => return Err(e),
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    Ok(Read { next_offset, error })
}

/// The merged order of several partitions' records by timestamp, each
/// partition's kept in its order, ties to the lower partition index
/// (`heapq.merge` with the timestamp as key): the first `limit` of its
/// (partition, index) pairs.
pub fn merge_by_timestamp(parts: &[&[i64]], limit: usize) -> Vec<(u32, u32)> {
    let total = parts.iter().map(|p| p.len()).sum::<usize>().min(limit);
    let mut out = Vec::with_capacity(total);
    if parts.len() == 1 {
        out.extend((0..total as u32).map(|i| (0, i)));
        return out;
    }
    let mut heap = BinaryHeap::with_capacity(parts.len());
    for (p, ts) in parts.iter().enumerate() {
        if let Some(&t) = ts.first() {
            heap.push(std::cmp::Reverse((t, p as u32, 0u32)));
        }
    }
    while out.len() < total {
        let Some(std::cmp::Reverse((_, p, i))) = heap.pop() else { break };
        out.push((p, i));
        if let Some(&t) = parts[p as usize].get(i as usize + 1) {
            heap.push(std::cmp::Reverse((t, p, i + 1)));
        }
    }
    out
}

// ----------------------------------------------------------- Fetch responses

/// One partition's answer in a Fetch response: its records are
/// `records` of the response's bytes (empty when the broker sent none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionAnswer<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub error_code: i16,
    pub high_watermark: i64,
    /// v4+.
    pub last_stable_offset: Option<i64>,
    /// v4+: (producer id, first offset); None when the broker sent null.
    pub aborted: Option<Vec<(i64, i64)>>,
    pub records: std::ops::Range<usize>,
}

/// A Fetch response's body (after the response header), versions 0 to 11
/// (the non-flexible ones, all aiokafka's `FetchRequest` sends): the
/// response's own error code (v7+, fetch sessions; 0 before) and each
/// partition's answer, the records left in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchAnswer<'a> {
    pub error_code: i16,
    pub partitions: Vec<PartitionAnswer<'a>>,
}

/// A cursor over a response's fixed-width fields (big-endian).
struct Fields<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<std::ops::Range<usize>, &'static str> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or("fetch response cut short")?;
        let out = self.at..end;
        self.at = end;
        Ok(out)
    }

    fn i16(&mut self) -> Result<i16, &'static str> {
        let r = self.take(2)?;
        Ok(be_i16(self.b, r.start))
    }

    fn i32(&mut self) -> Result<i32, &'static str> {
        let r = self.take(4)?;
        Ok(be_i32(self.b, r.start))
    }

    fn i64(&mut self) -> Result<i64, &'static str> {
        let r = self.take(8)?;
        Ok(be_i64(self.b, r.start))
    }

    /// An array's length; None for a null array. A length the bytes left
    /// cannot hold (at `min_item` bytes an item) is an error, so a
    /// corrupt length never reserves memory.
    fn array_len(&mut self, min_item: usize) -> Result<Option<usize>, &'static str> {
        match self.i32()? {
            -1 => Ok(None),
            n => {
                let n = usize::try_from(n).map_err(|_| "negative array length in fetch response")?;
                if n.saturating_mul(min_item) > self.b.len() - self.at {
                    return Err("fetch response cut short");
                }
                Ok(Some(n))
            }
        }
    }
}

/// Reads a Fetch response body of `version` (0..=11).
pub fn parse_fetch_response(b: &[u8], version: i16) -> Result<FetchAnswer<'_>, &'static str> {
    if !(0..=11).contains(&version) {
        return Err("fetch response version not read here");
    }
    let mut f = Fields { b, at: 0 };
    if version >= 1 {
        f.i32()?; // throttle time
    }
    let mut error_code = 0;
    if version >= 7 {
        error_code = f.i16()?;
        f.i32()?; // session id
    }
    let mut partitions = Vec::new();
    for _ in 0..f.array_len(6)?.unwrap_or(0) {
        let len = usize::try_from(f.i16()?).map_err(|_| "null topic name in fetch response")?;
        let name = f.take(len)?;
        let topic = std::str::from_utf8(&b[name]).map_err(|_| "topic name in fetch response not UTF-8")?;
        for _ in 0..f.array_len(18)?.unwrap_or(0) {
            let partition = f.i32()?;
            let error_code = f.i16()?;
            let high_watermark = f.i64()?;
            let (mut last_stable_offset, mut aborted) = (None, None);
            if version >= 4 {
                last_stable_offset = Some(f.i64()?);
                if version >= 5 {
                    f.i64()?; // log start offset
                }
                if let Some(n) = f.array_len(16)? {
                    let mut txns = Vec::with_capacity(n);
                    for _ in 0..n {
                        txns.push((f.i64()?, f.i64()?));
                    }
                    aborted = Some(txns);
                }
                if version >= 11 {
                    f.i32()?; // preferred read replica
                }
            }
            let records = match f.i32()? {
                -1 => f.at..f.at,
                n => f.take(usize::try_from(n).map_err(|_| "negative records size in fetch response")?)?,
            };
            partitions.push(PartitionAnswer {
                topic,
                partition,
                error_code,
                high_watermark,
                last_stable_offset,
                aborted,
                records,
            });
        }
    }
    Ok(FetchAnswer { error_code, partitions })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varlong(out: &mut Vec<u8>, v: i64) {
        let mut z = ((v << 1) ^ (v >> 63)) as u64;
        loop {
            let b = (z & 0x7f) as u8;
            z >>= 7;
            if z == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn field(out: &mut Vec<u8>, f: Option<&[u8]>) {
        match f {
            None => varlong(out, -1),
            Some(b) => {
                varlong(out, b.len() as i64);
                out.extend_from_slice(b);
            }
        }
    }

    struct Rec<'a> {
        offset_delta: i64,
        ts_delta: i64,
        key: Option<&'a [u8]>,
        value: Option<&'a [u8]>,
        headers: Vec<(&'a [u8], Option<&'a [u8]>)>,
    }

    fn rec<'a>(d: i64, key: &'a [u8], value: &'a [u8]) -> Rec<'a> {
        Rec { offset_delta: d, ts_delta: d * 10, key: Some(key), value: Some(value), headers: vec![] }
    }

    struct Spec {
        base: i64,
        attributes: i16,
        producer_id: i64,
        last_delta: Option<i32>,
    }

    fn plain(base: i64) -> Spec {
        Spec { base, attributes: 0, producer_id: -1, last_delta: None }
    }

    const BASE_TS: i64 = 1_700_000_000_000;

    fn records_bytes(recs: &[Rec<'_>]) -> Vec<u8> {
        let mut body = Vec::new();
        for r in recs {
            let mut one = vec![0u8];
            varlong(&mut one, r.ts_delta);
            varlong(&mut one, r.offset_delta);
            field(&mut one, r.key);
            field(&mut one, r.value);
            varlong(&mut one, r.headers.len() as i64);
            for (k, v) in &r.headers {
                field(&mut one, Some(k));
                field(&mut one, *v);
            }
            varlong(&mut body, one.len() as i64);
            body.extend_from_slice(&one);
        }
        body
    }

    fn batch_with_body(spec: &Spec, count: usize, last_delta: i32, body: &[u8]) -> Vec<u8> {
        let mut tail = Vec::new(); // from the attributes on
        tail.extend_from_slice(&spec.attributes.to_be_bytes());
        tail.extend_from_slice(&last_delta.to_be_bytes());
        tail.extend_from_slice(&BASE_TS.to_be_bytes());
        tail.extend_from_slice(&(BASE_TS + 999).to_be_bytes());
        tail.extend_from_slice(&spec.producer_id.to_be_bytes());
        tail.extend_from_slice(&0i16.to_be_bytes());
        tail.extend_from_slice(&0i32.to_be_bytes());
        tail.extend_from_slice(&(count as i32).to_be_bytes());
        tail.extend_from_slice(body);
        let mut out = Vec::new();
        out.extend_from_slice(&spec.base.to_be_bytes());
        out.extend_from_slice(&((tail.len() + 9) as i32).to_be_bytes());
        out.extend_from_slice(&0i32.to_be_bytes()); // leader epoch
        out.push(2);
        out.extend_from_slice(&crc32c(&tail).to_be_bytes());
        out.extend_from_slice(&tail);
        out
    }

    fn batch(spec: &Spec, recs: &[Rec<'_>]) -> Vec<u8> {
        let last = spec.last_delta.unwrap_or(recs.last().map_or(0, |r| r.offset_delta as i32));
        batch_with_body(spec, recs.len(), last, &records_bytes(recs))
    }

    fn control(base: i64, pid: i64, abort: bool) -> Vec<u8> {
        let key = [0u8, 0, 0, if abort { 0 } else { 1 }];
        let spec = Spec { base, attributes: CONTROL | TRANSACTIONAL, producer_id: pid, last_delta: None };
        batch(
            &spec,
            &[Rec { offset_delta: 0, ts_delta: 0, key: Some(&key), value: Some(&[0, 0, 0, 0, 0, 0]), headers: vec![] }],
        )
    }

    struct NoInflate;
    impl Inflate for NoInflate {
        fn inflate(&mut self, codec: u8, _: &[u8]) -> Result<Vec<u8>, String> {
            Err(format!("codec {codec}"))
        }
    }

    /// A codec 1..4 "compression" for the tests: the bytes reversed.
    struct Reverse;
    impl Inflate for Reverse {
        fn inflate(&mut self, _: u8, data: &[u8]) -> Result<Vec<u8>, String> {
            Ok(data.iter().rev().copied().collect())
        }
    }

    type Row = (i64, i64, Option<Vec<u8>>, Option<Vec<u8>>, Vec<(Vec<u8>, Option<Vec<u8>>)>);

    fn read_all(
        data: &[u8],
        from: i64,
        aborted: &[(i64, i64)],
        committed: bool,
        inflate: &mut dyn Inflate,
    ) -> (Vec<Row>, Read) {
        let mut rows = Vec::new();
        let read = read_partition::<()>(data, from, aborted, committed, true, inflate, |r, h| {
            rows.push((
                r.offset,
                r.timestamp,
                r.key.map(<[u8]>::to_vec),
                r.value.map(<[u8]>::to_vec),
                h.iter().map(|h| (h.key.to_vec(), h.value.map(<[u8]>::to_vec))).collect(),
            ));
            Ok(())
        })
        .unwrap();
        (rows, read)
    }

    fn offsets(rows: &[Row]) -> Vec<i64> {
        rows.iter().map(|r| r.0).collect()
    }

    #[test]
    fn reads_records_keys_values_headers_and_timestamps() {
        let mut r = rec(1, b"k1", b"v1");
        r.headers = vec![(b"kv-model", Some(b"m")), (b"kv-null", None)];
        let recs = [
            Rec { offset_delta: 0, ts_delta: -5, key: None, value: None, headers: vec![] },
            r,
            Rec { offset_delta: 2, ts_delta: 300, key: Some(b""), value: Some(&[7u8; 300]), headers: vec![] },
        ];
        let data = batch(&plain(40), &recs);
        let (rows, read) = read_all(&data, 40, &[], true, &mut NoInflate);
        assert_eq!(read, Read { next_offset: 43, error: None });
        assert_eq!(rows[0], (40, BASE_TS - 5, None, None, vec![]));
        assert_eq!(
            rows[1],
            (
                41,
                BASE_TS + 10,
                Some(b"k1".to_vec()),
                Some(b"v1".to_vec()),
                vec![(b"kv-model".to_vec(), Some(b"m".to_vec())), (b"kv-null".to_vec(), None)]
            )
        );
        assert_eq!(rows[2].0, 42);
        assert_eq!(rows[2].2, Some(vec![]));
        assert_eq!(rows[2].3.as_ref().map(Vec::len), Some(300));
    }

    #[test]
    fn log_append_time_gives_every_record_the_max_timestamp() {
        let spec = Spec { attributes: LOG_APPEND_TIME, ..plain(0) };
        let data = batch(&spec, &[rec(0, b"a", b"1"), rec(1, b"b", b"2")]);
        let (rows, _) = read_all(&data, 0, &[], true, &mut NoInflate);
        assert!(rows.iter().all(|r| r.1 == BASE_TS + 999));
    }

    #[test]
    fn a_partial_trailing_batch_is_ignored_and_fetched_again() {
        let mut data = batch(&plain(0), &[rec(0, b"a", b"1"), rec(1, b"b", b"2")]);
        let second = batch(&plain(2), &[rec(0, b"c", b"3")]);
        for cut in [1, 11, 12, 30, second.len() - 1] {
            let mut d = data.clone();
            d.extend_from_slice(&second[..cut]);
            let (rows, read) = read_all(&d, 0, &[], true, &mut NoInflate);
            assert_eq!(offsets(&rows), [0, 1]);
            assert_eq!(read, Read { next_offset: 2, error: None });
        }
        data.extend_from_slice(&second);
        let (rows, read) = read_all(&data, 0, &[], true, &mut NoInflate);
        assert_eq!(offsets(&rows), [0, 1, 2]);
        assert_eq!(read.next_offset, 3);
        // Nothing complete at all: nothing read, the position stays.
        let (rows, read) = read_all(&second[..20], 2, &[], true, &mut NoInflate);
        assert!(rows.is_empty());
        assert_eq!(read, Read { next_offset: 2, error: None });
    }

    #[test]
    fn records_below_the_fetch_offset_are_skipped() {
        let data = batch(&plain(10), &[rec(0, b"a", b"1"), rec(1, b"b", b"2"), rec(2, b"c", b"3")]);
        let (rows, read) = read_all(&data, 12, &[], true, &mut NoInflate);
        assert_eq!(offsets(&rows), [12]);
        assert_eq!(read.next_offset, 13);
    }

    #[test]
    fn compaction_gaps_and_the_batch_last_offset() {
        // Records 0 and 3 of 0..=5 remain: the next fetch starts past the batch.
        let spec = Spec { last_delta: Some(5), ..plain(100) };
        let data = batch(&spec, &[rec(0, b"a", b"1"), rec(3, b"b", b"2")]);
        let (rows, read) = read_all(&data, 100, &[], true, &mut NoInflate);
        assert_eq!(offsets(&rows), [100, 103]);
        assert_eq!(read.next_offset, 106);
    }

    #[test]
    fn control_batches_are_skipped() {
        let mut data = batch(&Spec { attributes: TRANSACTIONAL, producer_id: 7, ..plain(0) }, &[rec(0, b"a", b"1")]);
        data.extend(control(1, 7, false));
        data.extend(batch(&plain(2), &[rec(0, b"b", b"2")]));
        for committed in [true, false] {
            let (rows, read) = read_all(&data, 0, &[], committed, &mut NoInflate);
            assert_eq!(offsets(&rows), [0, 2]);
            assert_eq!(read.next_offset, 3);
        }
    }

    #[test]
    fn aborted_transactions_are_dropped_when_read_committed() {
        let txn = |base, pid| {
            batch(
                &Spec { attributes: TRANSACTIONAL, producer_id: pid, ..plain(base) },
                &[rec(0, b"t", b"x"), rec(1, b"t", b"y")],
            )
        };
        let mut data = txn(0, 7); // 0, 1: aborted
        data.extend(txn(2, 8)); // 2, 3: committed
        data.extend(control(4, 7, true));
        data.extend(control(5, 8, false));
        data.extend(txn(6, 7)); // 6, 7: a later transaction of 7, committed
        data.extend(control(8, 7, false));
        let aborted = [(7, 0)];
        let (rows, read) = read_all(&data, 0, &aborted, true, &mut NoInflate);
        assert_eq!(offsets(&rows), [2, 3, 6, 7]);
        assert_eq!(read.next_offset, 9);
        let (rows, _) = read_all(&data, 0, &aborted, false, &mut NoInflate);
        assert_eq!(offsets(&rows), [0, 1, 2, 3, 6, 7]);
        // An abort marker with nothing before it in the fetch.
        let (rows, read) = read_all(&control(4, 7, true), 4, &aborted, true, &mut NoInflate);
        assert!(rows.is_empty());
        assert_eq!(read.next_offset, 5);
    }

    #[test]
    fn compressed_batches_go_through_inflate() {
        let body: Vec<u8> = records_bytes(&[rec(0, b"a", b"1"), rec(1, b"b", b"2")]).into_iter().rev().collect();
        for codec in 1..=4 {
            let spec = Spec { attributes: codec, ..plain(5) };
            let data = batch_with_body(&spec, 2, 1, &body);
            let (rows, read) = read_all(&data, 6, &[], true, &mut Reverse);
            assert_eq!(offsets(&rows), [6]);
            assert_eq!(read.next_offset, 7);
            let (rows, read) = read_all(&data, 5, &[], true, &mut NoInflate);
            assert!(rows.is_empty());
            assert!(matches!(read.error, Some(Error::Inflate { base_offset: 5, .. })));
        }
    }

    #[test]
    fn bad_batches_stop_the_read_after_the_good_ones() {
        let good = batch(&plain(0), &[rec(0, b"a", b"1")]);
        let mut bad = batch(&plain(1), &[rec(0, b"b", b"2")]);
        let n = bad.len();
        bad[n - 1] ^= 1; // the CRC no longer matches
        let mut data = good.clone();
        data.extend(&bad);
        data.extend(batch(&plain(2), &[rec(0, b"c", b"3")]));
        let (rows, read) = read_all(&data, 0, &[], true, &mut NoInflate);
        assert_eq!(offsets(&rows), [0]);
        assert_eq!(read, Read { next_offset: 1, error: Some(Error::Crc { base_offset: 1 }) });

        let mut old = good.clone();
        old[16] = 1;
        let (_, read) = read_all(&old, 0, &[], true, &mut NoInflate);
        assert_eq!(read.error, Some(Error::Magic { base_offset: 0, magic: 1 }));

        // A record that claims more bytes than its batch holds.
        let mut body = records_bytes(&[rec(0, b"a", b"1")]);
        body[0] = 100;
        let data = batch_with_body(&plain(0), 1, 0, &body);
        let (rows, read) = read_all(&data, 0, &[], true, &mut NoInflate);
        assert!(rows.is_empty());
        assert!(matches!(read.error, Some(Error::Corrupt { base_offset: 0, .. })));

        let mut short = good.clone();
        short[8..12].copy_from_slice(&20i32.to_be_bytes());
        short.truncate(32);
        let (_, read) = read_all(&short, 0, &[], true, &mut NoInflate);
        assert!(matches!(read.error, Some(Error::Corrupt { .. })));
    }

    #[test]
    fn garbage_never_panics() {
        let good = {
            let mut d = batch(&plain(0), &[rec(0, b"a", b"1"), rec(1, b"b", b"2")]);
            d.extend(control(2, 3, true));
            d
        };
        let mut state = 0x1234_5678_u64;
        for round in 0..2000 {
            let mut d = good.clone();
            for _ in 0..(round % 4 + 1) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let at = (state as usize) % d.len();
                d[at] = (state >> 32) as u8;
            }
            let _ = read_partition::<()>(&d, 0, &[(3, 0)], true, round % 2 == 0, &mut Reverse, |_, _| Ok(()));
            let _ = read_partition::<()>(
                &d[..(state as usize) % d.len()],
                0,
                &[],
                true,
                false,
                &mut Reverse,
                |_, _| Ok(()),
            );
        }
    }

    /// A Fetch response body of `version`: one topic, its partitions
    /// (partition, error, aborted, records; None: null).
    /// (partition, error, aborted, records) of a test's fetch response.
    type Part<'a> = (i32, i16, Option<&'a [(i64, i64)]>, Option<&'a [u8]>);

    fn response(version: i16, topic: &str, parts: &[Part<'_>]) -> Vec<u8> {
        let mut out = Vec::new();
        if version >= 1 {
            out.extend_from_slice(&7i32.to_be_bytes()); // throttle
        }
        if version >= 7 {
            out.extend_from_slice(&0i16.to_be_bytes());
            out.extend_from_slice(&99i32.to_be_bytes()); // session
        }
        out.extend_from_slice(&1i32.to_be_bytes());
        out.extend_from_slice(&(topic.len() as i16).to_be_bytes());
        out.extend_from_slice(topic.as_bytes());
        out.extend_from_slice(&(parts.len() as i32).to_be_bytes());
        for &(partition, error, aborted, records) in parts {
            out.extend_from_slice(&partition.to_be_bytes());
            out.extend_from_slice(&error.to_be_bytes());
            out.extend_from_slice(&100i64.to_be_bytes()); // high watermark
            if version >= 4 {
                out.extend_from_slice(&90i64.to_be_bytes()); // last stable
                if version >= 5 {
                    out.extend_from_slice(&3i64.to_be_bytes()); // log start
                }
                match aborted {
                    None => out.extend_from_slice(&(-1i32).to_be_bytes()),
                    Some(txns) => {
                        out.extend_from_slice(&(txns.len() as i32).to_be_bytes());
                        for &(pid, first) in txns {
                            out.extend_from_slice(&pid.to_be_bytes());
                            out.extend_from_slice(&first.to_be_bytes());
                        }
                    }
                }
                if version >= 11 {
                    out.extend_from_slice(&(-1i32).to_be_bytes()); // preferred replica
                }
            }
            match records {
                None => out.extend_from_slice(&(-1i32).to_be_bytes()),
                Some(r) => {
                    out.extend_from_slice(&(r.len() as i32).to_be_bytes());
                    out.extend_from_slice(r);
                }
            }
        }
        out
    }

    #[test]
    fn fetch_responses_of_every_version_leave_the_records_in_place() {
        let data = batch(&plain(0), &[rec(0, b"a", b"1"), rec(1, b"b", b"2")]);
        let txns: &[(i64, i64)] = &[(7, 0), (8, 5)];
        for version in 0..=11 {
            let body = response(version, "events", &[(0, 0, Some(txns), Some(&data)), (2, 6, None, None)]);
            let answer = parse_fetch_response(&body, version).unwrap();
            assert_eq!(answer.error_code, 0);
            let [p0, p2] = &answer.partitions[..] else { panic!("two partitions") };
            assert_eq!((p0.topic, p0.partition, p0.error_code, p0.high_watermark), ("events", 0, 0, 100));
            assert_eq!(&body[p0.records.clone()], &data[..]);
            let (rows, _) = read_all(&body[p0.records.clone()], 0, &[], true, &mut NoInflate);
            assert_eq!(offsets(&rows), [0, 1]);
            assert_eq!((p2.partition, p2.error_code), (2, 6));
            assert!(p2.records.is_empty());
            if version >= 4 {
                assert_eq!(p0.last_stable_offset, Some(90));
                assert_eq!(p0.aborted.as_deref(), Some(txns));
                assert_eq!(p2.aborted, None);
            } else {
                assert_eq!((p0.last_stable_offset, &p0.aborted), (None, &None));
            }
        }
    }

    #[test]
    fn bad_fetch_responses_are_errors_never_panics() {
        let data = batch(&plain(0), &[rec(0, b"a", b"1")]);
        let body = response(11, "events", &[(0, 0, Some(&[(1, 2)]), Some(&data))]);
        for cut in 0..body.len() {
            assert!(parse_fetch_response(&body[..cut], 11).is_err(), "cut at {cut}");
        }
        assert!(parse_fetch_response(&body, 12).is_err());
        assert!(parse_fetch_response(&body, -1).is_err());
        let mut bad_name = body.clone();
        bad_name[16] = 0xff; // the topic name's first byte (after throttle, error, session, count, length)
        assert!(parse_fetch_response(&bad_name, 11).is_err());
        // A claimed count far past the bytes left reserves nothing.
        let mut huge = body.clone();
        huge[10..14].copy_from_slice(&i32::MAX.to_be_bytes());
        assert!(parse_fetch_response(&huge, 11).is_err());
        let mut state = 0x9e37_79b9_u64;
        for _ in 0..5000 {
            let mut b = body.clone();
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let at = (state as usize) % b.len();
            b[at] = (state >> 40) as u8;
            if let Ok(answer) = parse_fetch_response(&b, 11) {
                for p in answer.partitions {
                    assert!(p.records.end <= b.len());
                }
            }
        }
    }

    #[test]
    fn merge_is_heapq_merge_by_timestamp() {
        let a: &[i64] = &[1, 5, 5, 9];
        let b: &[i64] = &[0, 5, 10];
        let c: &[i64] = &[];
        let order = merge_by_timestamp(&[a, b, c], usize::MAX);
        assert_eq!(order, [(1, 0), (0, 0), (0, 1), (0, 2), (1, 1), (0, 3), (1, 2)]);
        assert_eq!(merge_by_timestamp(&[a, b, c], 3), order[..3]);
        assert_eq!(merge_by_timestamp(&[a], 2), [(0, 0), (0, 1)]);
        // Within a partition the order is kept even when clocks disagree.
        let d: &[i64] = &[9, 1];
        assert_eq!(merge_by_timestamp(&[d, &[5]], 9), [(1, 0), (0, 0), (0, 1)]);
        assert_eq!(merge_by_timestamp(&[d], 9), [(0, 0), (0, 1)]);
    }

    /// Property tests: the parser against the builders above.
    mod props {
        use super::*;
        use proptest::prelude::*;

        type Bytes = Option<Vec<u8>>;
        /// A record as generated: offset gap from the one before, timestamp
        /// delta, key, value, headers.
        type Gen = (i64, i64, Bytes, Bytes, Vec<(Vec<u8>, Bytes)>);

        fn bytes() -> impl Strategy<Value = Bytes> {
            prop::option::of(prop::collection::vec(any::<u8>(), 0..40))
        }

        fn record() -> impl Strategy<Value = Gen> {
            (
                1i64..4,
                -1000i64..1000,
                bytes(),
                bytes(),
                prop::collection::vec((prop::collection::vec(any::<u8>(), 0..12), bytes()), 0..3),
            )
        }

        /// Batches of 1..5 records each, from offset `base`; the bytes and
        /// the rows `read_partition` should give.
        fn encode(base: i64, batches: &[Vec<Gen>]) -> (Vec<u8>, Vec<Row>, Vec<usize>) {
            let mut data = Vec::new();
            let mut rows = Vec::new();
            let mut ends = Vec::new(); // rows complete at each batch's end
            let mut next = base;
            for gens in batches {
                let mut delta = -1;
                let recs: Vec<Rec<'_>> = gens
                    .iter()
                    .map(|(gap, ts, k, v, h)| {
                        delta += gap;
                        Rec {
                            offset_delta: delta,
                            ts_delta: *ts,
                            key: k.as_deref(),
                            value: v.as_deref(),
                            headers: h.iter().map(|(hk, hv)| (hk.as_slice(), hv.as_deref())).collect(),
                        }
                    })
                    .collect();
                for r in &recs {
                    rows.push((
                        next + r.offset_delta,
                        BASE_TS + r.ts_delta,
                        r.key.map(<[u8]>::to_vec),
                        r.value.map(<[u8]>::to_vec),
                        r.headers.iter().map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec))).collect(),
                    ));
                }
                data.extend(batch(&plain(next), &recs));
                next += delta + 1;
                ends.push(rows.len());
            }
            (data, rows, ends)
        }

        fn batches() -> impl Strategy<Value = (i64, Vec<Vec<Gen>>)> {
            (0i64..1 << 40, prop::collection::vec(prop::collection::vec(record(), 1..5), 0..5))
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            /// Every record written is read back, in order, with its offset,
            /// timestamp, key, value and headers; the next offset is past
            /// the last batch.
            #[test]
            fn records_written_are_read_back((base, gens) in batches()) {
                let (data, want, _) = encode(base, &gens);
                let (rows, read) = read_all(&data, base, &[], true, &mut NoInflate);
                prop_assert_eq!(read.error, None);
                let next = want.last().map_or(base, |r| r.0 + 1);
                prop_assert_eq!(read.next_offset, next);
                prop_assert_eq!(rows, want);
            }

            /// Bytes cut anywhere (a fetch's size limit) read the complete
            /// batches before the cut and nothing of the partial one.
            #[test]
            fn a_cut_reads_the_complete_batches((base, gens) in batches(), cut in any::<prop::sample::Index>()) {
                let (data, want, ends) = encode(base, &gens);
                let cut = cut.index(data.len() + 1);
                let (rows, read) = read_all(&data[..cut], base, &[], true, &mut NoInflate);
                prop_assert_eq!(read.error, None);
                // The batches that end at or before the cut.
                let mut end = 0;
                let mut at = 0;
                for &n in &ends {
                    let size = batch_len(&data[at..]);
                    if at + size > cut {
                        break;
                    }
                    at += size;
                    end = n;
                }
                prop_assert_eq!(&rows[..], &want[..end]);
            }

            /// A changed byte past the CRC field is caught by the CRC: the
            /// batches before it are read, then the read stops with an error
            /// (or, in a batch's length, the read stops short).
            #[test]
            fn a_flipped_byte_never_passes_unnoticed(
                (base, gens) in batches(),
                at in any::<prop::sample::Index>(),
                flip in 1u8..=255,
            ) {
                let (mut data, want, _) = encode(base, &gens);
                prop_assume!(!data.is_empty());
                let at = at.index(data.len());
                // Which batch the byte is in, and where that batch starts.
                let (mut start, mut batch_ix) = (0, 0);
                while start + batch_len(&data[start..]) <= at {
                    start += batch_len(&data[start..]);
                    batch_ix += 1;
                }
                data[at] ^= flip;
                let (rows, read) = read_all(&data, base, &[], true, &mut NoInflate);
                let within = at - start;
                if within >= CRC_FROM {
                    // Records of the batches before it only, then the CRC's error.
                    prop_assert_eq!(read.error, Some(Error::Crc { base_offset: be_i64(&data, start) }));
                    let before = gens[..batch_ix].iter().map(Vec::len).sum::<usize>();
                    prop_assert_eq!(&rows[..], &want[..before]);
                } else {
                    // In the base offset, length, epoch, magic or CRC: never a
                    // record that was not written.
                    for r in &rows {
                        prop_assert!(want.iter().any(|w| w.2 == r.2 && w.3 == r.3 && w.4 == r.4));
                    }
                }
            }

            /// Any bytes at all: an answer or an error, never a panic.
            #[test]
            fn any_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..600), check in any::<bool>()) {
                let _ = read_partition::<()>(&data, 0, &[(3, 0)], true, check, &mut Reverse, |_, _| Ok(()));
                for version in [4i16, 11, 12, 13, 16] {
                    let _ = parse_fetch_response(&data, version);
                }
            }
        }

        /// The size of the batch at the start of `data` (it is complete).
        fn batch_len(data: &[u8]) -> usize {
            LOG_OVERHEAD + be_i32(data, 8) as usize
        }
    }
}
