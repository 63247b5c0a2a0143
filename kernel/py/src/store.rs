//! `BlockStore`: `kvconductor_core::store::Store` (a namespace's per-block
//! state, `kvconductor/index/block_store.py`'s `PyBlockStore` call for call)
//! as a Python class: the arguments converted, the lock taken, a
//! `store::Error` raised as the exception `PyBlockStore` raises.

use std::convert::Infallible;
use std::sync::{Mutex, MutexGuard, PoisonError};

use kvconductor_core::store::{self, Error, Exported, Placed, Prompt, Source, Store};
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyKeyError, PyOverflowError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList};

use crate::shape::AnswerShape;

/// The exception `PyBlockStore` raises for `e`.
pub(crate) fn store_err(e: Error) -> PyErr {
    match e {
        Error::NotHeld(seq) | Error::Unknown(seq) => PyKeyError::new_err(seq),
        Error::NoOwner(slot) => PyKeyError::new_err(slot),
        Error::NoPool(pid) => PyKeyError::new_err(pid),
        Error::TierOutOfRange | Error::FewerIdentities => PyIndexError::new_err(e.to_string()),
        Error::SlotOutOfRange | Error::BadBytes | Error::RetiredLengths | Error::BlockSize | Error::CountsDiffer(_) => {
            PyValueError::new_err(e.to_string())
        }
        Error::NotEmpty(_)
        | Error::NoCutOpen
        | Error::EndCutWithoutBegin
        | Error::TierNotFrozen
        | Error::PoolNotFrozen => PyAssertionError::new_err(e.to_string()),
    }
}

/// A walk whose identities cannot fail (never an error).
fn sure<T>(r: Result<T, Infallible>) -> T {
    match r {
        Ok(v) => v,
        Err(never) => match never {},
    }
}

// ---------------------------------------------------------------- python io

/// A sequence of ints as u64 (lists without the iterator protocol).
fn u64s(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(list) = obj.cast::<PyList>() {
        if let Some(out) = list_u64s(list) {
            return Ok(out);
        }
        // Some item is not an int in range: convert each, to raise its error.
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(item.extract()?);
        }
        return Ok(out);
    }
    obj.try_iter()?.map(|item| item?.extract()).collect()
}

/// A list of ints in [0, 2**64) read in place, without a conversion object
/// per item (pyo3's per-item extraction was ~4% of applying events); None
/// when an item is anything else.
fn list_u64s(list: &Bound<'_, PyList>) -> Option<Vec<u64>> {
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    // SAFETY: a list's items are `ob_item[..len]`; nothing here runs Python
    // code (reading an exact int's value does not), so the list keeps its
    // `n` items throughout.
    let items = unsafe { (*list.as_ptr().cast::<ffi::PyListObject>()).ob_item };
    for i in 0..n {
        let item = unsafe { *items.add(i) };
        if unsafe { ffi::PyLong_CheckExact(item) } == 0 {
            return None;
        }
        let value = unsafe { ffi::PyLong_AsUnsignedLongLong(item) };
        if value == u64::MAX && unsafe { !ffi::PyErr_Occurred().is_null() } {
            // Negative or past 64 bits: the caller's conversion says which.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        out.push(value);
    }
    Some(out)
}

/// A capacity left, as i64 (any Python int: beyond i64 it saturates).
fn room_of(room: &Bound<'_, PyAny>) -> PyResult<i64> {
    match room.extract::<i64>() {
        Err(e) if e.is_instance_of::<PyOverflowError>(room.py()) => Ok(if room.gt(0)? { i64::MAX } else { i64::MIN }),
        other => other,
    }
}

fn pack<'py>(py: Python<'py>, values: impl ExactSizeIterator<Item = u64>) -> Bound<'py, PyBytes> {
    let mut buf = Vec::with_capacity(values.len() * 8);
    for v in values {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    PyBytes::new(py, &buf)
}

/// A Python int as 64-bit words, least significant first.
fn int_words(v: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(w) = v.extract::<u64>() {
        return Ok(vec![w]);
    }
    let bits: usize = v.call_method0("bit_length")?.extract()?;
    let n = bits.div_ceil(64) * 8;
    let raw = v.call_method1("to_bytes", (n, "little"))?;
    unpack(raw.cast::<PyBytes>()?.as_bytes())
}

fn words_int<'py>(py: Python<'py>, words: &[u64]) -> PyResult<Bound<'py, PyAny>> {
    match words.iter().rposition(|w| *w != 0) {
        None => Ok(0u64.into_pyobject(py)?.into_any()),
        Some(0) => Ok(words[0].into_pyobject(py)?.into_any()),
        Some(top) => {
            let raw = pack(py, words[..=top].iter().copied());
            py.get_type::<PyInt>().call_method1("from_bytes", (raw, "little"))
        }
    }
}

/// A prompt's identities read from a Python list as far as the walk goes.
struct ListSource<'a, 'py>(&'a Bound<'py, PyList>);

impl Source for ListSource<'_, '_> {
    type Error = PyErr;
    fn ident(&mut self, i: usize) -> PyResult<Option<u64>> {
        Ok(Some(self.0.get_item(i)?.extract()?))
    }
}

/// The JSON answer of a walk's lengths (`AnswerShape::json_of`).
fn answer_json<'py>(
    shape: &Bound<'py, AnswerShape>,
    found: Vec<(usize, u32, u32, u32)>,
) -> PyResult<Bound<'py, PyBytes>> {
    let listed = found.into_iter().map(|(s, g, c, d)| (s, (u64::from(g), u64::from(c), u64::from(d)))).collect();
    shape.borrow_mut().json_of(shape.py(), listed)
}

fn exported<'py>(py: Python<'py>, (seqs, idents): Exported) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
    (pack(py, seqs.into_iter()), pack(py, idents.into_iter()))
}

fn unpack(data: &[u8]) -> PyResult<Vec<u64>> {
    store::unpack(data).map_err(store_err)
}

/// `kvconductor.index.block_store.PyBlockStore`, compiled. Frozen, with
/// its blocks behind a lock: the engine lane applies records with the GIL
/// released (`EngineLane.run_free`, one record a hold) while queries and
/// snapshots take the lock on the event loop's thread.
#[pyclass(module = "kvconductor._kernel", frozen)]
pub struct BlockStore {
    state: Mutex<Store>,
}

impl BlockStore {
    /// A panic under the lock (a bug) left the store as it was then; the
    /// next call still gets it.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Store> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl BlockStore {
    #[new]
    fn new(max_retired: usize, max_age_s: f64) -> Self {
        BlockStore { state: Mutex::new(Store::new(max_retired, max_age_s)) }
    }

    // ------------------------------------------------------------- catalog

    fn set_now(&self, now: f64) {
        self.lock().set_now(now);
    }

    fn ident(&self, seq: u64) -> Option<u64> {
        self.lock().ident(seq)
    }

    fn identities_of(&self, seqs: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let this = self.lock();
        Ok(this.identities_of(&u64s(seqs)?))
    }

    fn acquire(&self, seq: u64, ident: u64) -> u64 {
        self.lock().acquire(seq, ident)
    }

    fn release(&self, seq: u64) -> PyResult<()> {
        self.lock().release(seq).map_err(store_err)
    }

    fn remember(&self, seq: u64, ident: u64) {
        self.lock().remember(seq, ident);
    }

    fn pool_holds(&self, ident: u64) -> bool {
        self.lock().pool_holds(ident)
    }

    fn content_len(&self) -> usize {
        self.lock().content_len()
    }

    // ------------------------------------------------------------- retired

    fn expire(&self, now: f64) {
        self.lock().expire(now);
    }

    fn retired_len(&self) -> usize {
        self.lock().retired_len()
    }

    fn retired_version(&self) -> u64 {
        self.lock().retired_version()
    }

    fn export_retired<'py>(&self, py: Python<'py>) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
        let items = self.lock().export_retired();
        // An f64's little-endian bytes are its bit pattern's.
        (
            pack(py, items.iter().map(|r| r.0)),
            pack(py, items.iter().map(|r| r.1)),
            pack(py, items.iter().map(|r| r.2.to_bits())),
        )
    }

    fn load_retired(&self, seqs: &[u8], idents: &[u8], ts: &[u8]) -> PyResult<()> {
        self.lock().load_retired(seqs, idents, ts).map_err(store_err)
    }

    fn clear_retired(&self) {
        self.lock().clear_retired();
    }

    // ----------------------------------------------------------------- cuts

    fn begin_cut(&self) {
        self.lock().begin_cut();
    }

    fn end_cut(&self) -> PyResult<()> {
        self.lock().end_cut().map_err(store_err)
    }

    fn freeze_owner(&self, slot: usize) -> PyResult<()> {
        self.lock().freeze_owner(slot).map_err(store_err)
    }

    fn cut_owner_seqs<'py>(&self, py: Python<'py>, slot: usize, tier: usize) -> PyResult<Bound<'py, PyBytes>> {
        let seqs = self.lock().cut_owner_seqs(slot, tier).map_err(store_err)?;
        Ok(pack(py, seqs.into_iter()))
    }

    fn freeze_pool(&self, pid: i64) -> PyResult<()> {
        self.lock().freeze_pool(pid).map_err(store_err)
    }

    fn cut_pool_seqs<'py>(&self, py: Python<'py>, pid: i64) -> PyResult<Bound<'py, PyBytes>> {
        let seqs = self.lock().cut_pool_seqs(pid).map_err(store_err)?;
        Ok(pack(py, seqs.into_iter()))
    }

    fn cut_identities<'py>(&self, py: Python<'py>, seqs: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let idents = self.lock().cut_identities(seqs).map_err(store_err)?;
        Ok(pack(py, idents.into_iter()))
    }

    fn retired_limit(&self) -> usize {
        self.lock().retired_limit()
    }

    fn set_retired_limit(&self, limit: usize) {
        self.lock().set_retired_limit(limit);
    }

    // -------------------------------------------------------------- owners

    fn add_owner(&self, slot: usize) -> PyResult<()> {
        self.lock().add_owner(slot).map_err(store_err)
    }

    fn drop_owner(&self, slot: usize) -> PyResult<()> {
        self.lock().drop_owner(slot).map_err(store_err)
    }

    fn owner_size(&self, slot: usize) -> PyResult<usize> {
        self.lock().owner_size(slot).map_err(store_err)
    }

    fn tier_len(&self, slot: usize, tier: usize) -> PyResult<usize> {
        self.lock().tier_len(slot, tier).map_err(store_err)
    }

    fn count_new(&self, slot: usize, tier: usize, seqs: &Bound<'_, PyAny>) -> PyResult<usize> {
        let this = self.lock();
        let held = this.owner_tier_set(slot, tier).map_err(store_err)?;
        Ok(u64s(seqs)?.iter().filter(|s| !held.contains(s)).count())
    }

    fn place_owner(
        &self,
        slot: usize,
        tier: usize,
        seqs: &Bound<'_, PyAny>,
        idents: Option<&Bound<'_, PyAny>>,
        room: &Bound<'_, PyAny>,
    ) -> PyResult<Placed> {
        let mut this = self.lock();
        let (seqs, idents, room) = (u64s(seqs)?, idents.map(u64s).transpose()?, room_of(room)?);
        this.place_owner(slot, tier, &seqs, idents.as_deref(), room).map_err(store_err)
    }

    fn remove_owner(&self, slot: usize, tier: usize, seqs: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let mut this = self.lock();
        let seqs = u64s(seqs)?;
        this.remove_owner(slot, tier, &seqs).map_err(store_err)
    }

    fn clear_owner(&self, slot: usize) -> PyResult<usize> {
        self.lock().clear_owner(slot).map_err(store_err)
    }

    fn export_owner<'py>(
        &self,
        py: Python<'py>,
        slot: usize,
        tier: usize,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let held = self.lock().export_owner(slot, tier).map_err(store_err)?;
        Ok(exported(py, held))
    }

    fn load_owner(&self, slot: usize, tier: usize, seqs: &[u8], idents: &[u8]) -> PyResult<()> {
        self.lock().load_owner(slot, tier, seqs, idents).map_err(store_err)
    }

    // --------------------------------------------------------------- pools

    fn add_pool(&self, pid: i64, tier: usize) -> PyResult<()> {
        self.lock().add_pool(pid, tier).map_err(store_err)
    }

    fn drop_pool(&self, pid: i64) -> PyResult<()> {
        self.lock().drop_pool(pid).map_err(store_err)
    }

    fn pool_len(&self, pid: i64) -> PyResult<usize> {
        self.lock().pool_len(pid).map_err(store_err)
    }

    #[pyo3(signature = (pid, seqs, idents, room, placed_out))]
    fn place_pool(
        &self,
        pid: i64,
        seqs: &Bound<'_, PyAny>,
        idents: Option<&Bound<'_, PyAny>>,
        room: &Bound<'_, PyAny>,
        placed_out: Option<&Bound<'_, PyList>>,
    ) -> PyResult<Placed> {
        let mut this = self.lock();
        let (seqs, idents, room) = (u64s(seqs)?, idents.map(u64s).transpose()?, room_of(room)?);
        let mut placed = Vec::new();
        let out = placed_out.is_some().then_some(&mut placed);
        let result = this.place_pool(pid, &seqs, idents.as_deref(), room, out);
        // The hashes newly held, those before an error too.
        if let Some(list) = placed_out {
            for seq in placed {
                list.append(seq)?;
            }
        }
        result.map_err(store_err)
    }

    fn remove_pool(&self, pid: i64, seq: u64) -> PyResult<bool> {
        self.lock().remove_pool(pid, seq).map_err(store_err)
    }

    fn clear_pool(&self, pid: i64) -> PyResult<usize> {
        self.lock().clear_pool(pid).map_err(store_err)
    }

    fn export_pool<'py>(&self, py: Python<'py>, pid: i64) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let held = self.lock().export_pool(pid).map_err(store_err)?;
        Ok(exported(py, held))
    }

    fn load_pool(&self, pid: i64, seqs: &[u8], idents: &[u8]) -> PyResult<()> {
        self.lock().load_pool(pid, seqs, idents).map_err(store_err)
    }

    // --------------------------------------------------------------- query

    /// The walk over packed u32 tokens, hashed block by block as far as
    /// it goes (a trailing partial block is not a block). `listed` says
    /// which 64-slot words to walk.
    #[pyo3(signature = (data, block_size, seed, listed))]
    fn match_tokens(
        &self,
        data: &[u8],
        block_size: usize,
        seed: u64,
        listed: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, u32, u32, u32)>> {
        let this = self.lock();
        let mut prompt = Prompt::tokens(data, block_size, seed).map_err(store_err)?;
        let words = int_words(listed)?;
        Ok(sure(this.matched(&mut prompt, &words)))
    }

    #[pyo3(signature = (idents, listed))]
    fn match_identities(
        &self,
        idents: &Bound<'_, PyAny>,
        listed: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<(usize, u32, u32, u32)>> {
        let this = self.lock();
        if let Ok(list) = idents.cast::<PyList>() {
            let mut prompt = Prompt::new(ListSource(list), list.len());
            let words = int_words(listed)?;
            this.matched(&mut prompt, &words)
        } else {
            let mut prompt = Prompt::given(u64s(idents)?);
            let words = int_words(listed)?;
            Ok(sure(this.matched(&mut prompt, &words)))
        }
    }

    /// `shape.shape_json(match_tokens(...))`, the lengths never made
    /// Python objects.
    #[pyo3(signature = (data, block_size, seed, listed, shape))]
    fn match_tokens_json<'py>(
        &self,
        data: &[u8],
        block_size: usize,
        seed: u64,
        listed: &Bound<'py, PyAny>,
        shape: &Bound<'py, AnswerShape>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        answer_json(shape, self.match_tokens(data, block_size, seed, listed)?)
    }

    /// `shape.shape_json(match_identities(...))`, likewise.
    #[pyo3(signature = (idents, listed, shape))]
    fn match_identities_json<'py>(
        &self,
        idents: &Bound<'py, PyAny>,
        listed: &Bound<'py, PyAny>,
        shape: &Bound<'py, AnswerShape>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        answer_json(shape, self.match_identities(idents, listed)?)
    }

    // --------------------------------------------------------------- tests

    /// Every map as `PyBlockStore.dump` gives it.
    fn dump<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = self.lock().dump();
        let content = PyDict::new(py);
        for (seq, ident) in d.content {
            content.set_item(seq, ident)?;
        }
        let refs = PyDict::new(py);
        for (seq, n) in d.refs {
            refs.set_item(seq, n)?;
        }
        let masks = PyList::empty(py);
        for joined in d.masks {
            let tier = PyDict::new(py);
            for (ident, words) in joined {
                tier.set_item(ident, words_int(py, &words)?)?;
            }
            masks.append(tier)?;
        }
        let pool_counts = PyList::empty(py);
        for counts in d.pool_counts {
            pool_counts.append(counts.into_iter().collect::<std::collections::HashMap<_, _>>())?;
        }
        let held = |pairs: Vec<(u64, u64)>| -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            for (seq, ident) in pairs {
                d.set_item(seq, ident)?;
            }
            Ok(d)
        };
        let owners = PyDict::new(py);
        for (slot, tiers_held, dups) in d.owners {
            let tiers = PyList::empty(py);
            for t in tiers_held {
                tiers.append(held(t)?)?;
            }
            let dups: std::collections::HashMap<_, _> = dups.into_iter().collect();
            owners.set_item(slot, (tiers, dups))?;
        }
        let pools = PyDict::new(py);
        for (pid, tier, blocks) in d.pools {
            pools.set_item(pid, (tier, held(blocks)?))?;
        }
        let out = PyDict::new(py);
        out.set_item("content", content)?;
        out.set_item("refs", refs)?;
        out.set_item("retired", d.retired)?;
        out.set_item("masks", masks)?;
        out.set_item("pool_counts", pool_counts)?;
        out.set_item("owners", owners)?;
        out.set_item("pools", pools)?;
        Ok(out)
    }
}
