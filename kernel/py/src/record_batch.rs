//! The Python edge of `kvconductor_core::kafka` (the record batches of a
//! native fetch, `consumers/fetcher.py`): a batch's records become the
//! `core.Incoming`s the consumer applies, with no Python per record; a
//! compressed batch goes to aiokafka's codecs through `Inflate`.

use hashbrown::HashMap;
use kvconductor_core::kafka::*;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyFloat, PyList, PyString, PyTuple, PyType};

/// Distinct values remembered per header name, and keys: past them a
/// value (a `kv-seq`) is made each time rather than remembered.
const VALUES_PER_NAME: usize = 64;
const KEYS: usize = 1 << 16;

struct Name {
    text: Py<PyString>,
    /// Value -> the (name, value) pair, shared by every record with it.
    pairs: HashMap<Option<Vec<u8>>, Py<PyTuple>>,
}

/// A header value to look up among owned ones without copying it.
#[derive(Hash)]
struct Val<'a>(Option<&'a [u8]>);

impl hashbrown::Equivalent<Option<Vec<u8>>> for Val<'_> {
    fn equivalent(&self, key: &Option<Vec<u8>>) -> bool {
        self.0 == key.as_deref()
    }
}

struct Calls<'py> {
    py: Python<'py>,
    inflate: &'py Bound<'py, PyAny>,
}

impl Inflate for Calls<'_> {
    fn inflate(&mut self, codec: u8, data: &[u8]) -> Result<Vec<u8>, String> {
        let out = self.inflate.call1((codec, PyBytes::new(self.py, data))).map_err(|e| e.to_string())?;
        let out = out.cast_into::<PyBytes>().map_err(|e| e.to_string())?;
        Ok(out.as_bytes().to_vec())
    }
}

/// Reads fetched partitions into `core.Incoming`s (see the module doc).
#[pyclass(module = "kvconductor._kernel")]
pub struct RecordReader {
    incoming: Py<PyType>,
    inflate: Py<PyAny>,
    kind_header: Vec<u8>,
    origin_key_header: Vec<u8>,
    names: HashMap<Vec<u8>, Name>,
    keys: HashMap<Vec<u8>, Py<PyBytes>>,
    check_crc: bool,
}

/// One partition's records as read: `records` (Incoming) with their
/// offsets and timestamps (ms), the offset to fetch next, and why the
/// read stopped early (None: it did not).
#[pyclass(module = "kvconductor._kernel", frozen)]
pub struct Fetched {
    #[pyo3(get)]
    records: Py<PyList>,
    offsets: Vec<i64>,
    timestamps: Vec<i64>,
    #[pyo3(get)]
    next_offset: i64,
    #[pyo3(get)]
    error: Option<String>,
}

#[pymethods]
impl Fetched {
    fn __len__(&self) -> usize {
        self.offsets.len()
    }

    /// How many of the records are at `start` or past it.
    fn remaining(&self, start: i64) -> usize {
        self.offsets.len() - self.offsets.partition_point(|&o| o < start)
    }

    #[getter]
    fn offsets(&self) -> Vec<i64> {
        self.offsets.clone()
    }

    #[getter]
    fn timestamps(&self) -> Vec<i64> {
        self.timestamps.clone()
    }
}

/// Several partitions' records in produce order (`merge`).
#[pyclass(module = "kvconductor._kernel", frozen)]
pub struct Merged {
    #[pyo3(get)]
    records: Py<PyList>,
    parts: Vec<u32>,
    offsets: Vec<i64>,
    timestamps: Vec<i64>,
    n_parts: usize,
}

#[pymethods]
impl Merged {
    fn __len__(&self) -> usize {
        self.offsets.len()
    }

    /// Record `i`'s (partition index, offset, timestamp in ms).
    fn at(&self, i: usize) -> PyResult<(u32, i64, i64)> {
        if i >= self.offsets.len() {
            return Err(pyo3::exceptions::PyIndexError::new_err("record index out of range"));
        }
        Ok((self.parts[i], self.offsets[i], self.timestamps[i]))
    }

    /// Per partition with records in `[start, end)`: (partition index,
    /// the offset after its last there, how many there).
    fn through(&self, start: usize, end: usize) -> Vec<(u32, i64, usize)> {
        let end = end.min(self.offsets.len());
        let mut last: Vec<Option<(i64, usize)>> = vec![None; self.n_parts];
        for i in start.min(end)..end {
            let slot = &mut last[self.parts[i] as usize];
            let n = slot.map_or(0, |(_, n)| n);
            *slot = Some((self.offsets[i] + 1, n + 1));
        }
        last.iter().enumerate().filter_map(|(p, s)| s.map(|(next, n)| (p as u32, next, n))).collect()
    }
}

/// The first `limit` of `parts`' records from `starts[i]` on (the
/// offsets below were handed out already) merged by timestamp (see
/// `merge_by_timestamp`).
#[pyfunction]
pub fn merge_fetched(
    py: Python<'_>,
    parts: Vec<PyRef<'_, Fetched>>,
    starts: Vec<i64>,
    limit: usize,
) -> PyResult<Merged> {
    if parts.len() != starts.len() {
        return Err(PyValueError::new_err("one start offset a part"));
    }
    let firsts: Vec<usize> = parts.iter().zip(&starts).map(|(p, &s)| p.offsets.partition_point(|&o| o < s)).collect();
    let stamps: Vec<&[i64]> = parts.iter().zip(&firsts).map(|(p, &f)| &p.timestamps[f..]).collect();
    let order = merge_by_timestamp(&stamps, limit);
    let lists: Vec<&Bound<'_, PyList>> = parts.iter().map(|p| p.records.bind(py)).collect();
    let mut out = Merged {
        records: PyList::empty(py).unbind(),
        parts: Vec::with_capacity(order.len()),
        offsets: Vec::with_capacity(order.len()),
        timestamps: Vec::with_capacity(order.len()),
        n_parts: parts.len(),
    };
    let items: Vec<Bound<'_, PyAny>> = order
        .iter()
        .map(|&(p, i)| {
            let (p, j) = (p as usize, firsts[p as usize] + i as usize);
            out.parts.push(p as u32);
            out.offsets.push(parts[p].offsets[j]);
            out.timestamps.push(parts[p].timestamps[j]);
            lists[p].get_item(j)
        })
        .collect::<PyResult<_>>()?;
    out.records = PyList::new(py, items)?.unbind();
    Ok(out)
}

/// `t`, of bytes, str, None and untracked tuples only, left out of the
/// cyclic GC, as CPython itself leaves such tuples once it meets them:
/// it can be in no cycle. A fetch keeps tens of thousands of records
/// alive while they are applied, and each collection of the youngest
/// generation walked them all: 2-3x the cost of reading them.
fn untracked(t: Bound<'_, PyTuple>) -> Bound<'_, PyTuple> {
    // SAFETY: a live, tracked tuple (just made by PyTuple::new).
    unsafe { ffi::PyObject_GC_UnTrack(t.as_ptr().cast()) };
    t
}

impl RecordReader {
    fn key(&mut self, py: Python<'_>, key: &[u8]) -> Py<PyBytes> {
        if let Some(k) = self.keys.get(key) {
            return k.clone_ref(py);
        }
        let k = PyBytes::new(py, key).unbind();
        if self.keys.len() < KEYS {
            self.keys.insert(key.to_vec(), k.clone_ref(py));
        }
        k
    }

    fn pair(&mut self, py: Python<'_>, h: &Header<'_>) -> PyResult<Py<PyTuple>> {
        let name = match self.names.get_mut(h.key) {
            Some(n) => n,
            None => {
                let text =
                    std::str::from_utf8(h.key).map_err(|_| PyValueError::new_err("a header name is not UTF-8"))?;
                let name = Name { text: PyString::new(py, text).unbind(), pairs: HashMap::new() };
                self.names.entry(h.key.to_vec()).or_insert(name)
            }
        };
        if let Some(pair) = name.pairs.get(&Val(h.value)) {
            return Ok(pair.clone_ref(py));
        }
        let value: Bound<'_, PyAny> = match h.value {
            Some(v) => PyBytes::new(py, v).into_any(),
            None => py.None().into_bound(py),
        };
        let pair = untracked(PyTuple::new(py, [name.text.bind(py).clone().into_any(), value])?).unbind();
        if name.pairs.len() < VALUES_PER_NAME {
            name.pairs.insert(h.value.map(<[u8]>::to_vec), pair.clone_ref(py));
        }
        Ok(pair)
    }

    /// An `Incoming` made as its `__new__` makes it (a tuple of the
    /// type), without the Python call.
    fn incoming(&self, py: Python<'_>, items: [Bound<'_, PyAny>; 5]) -> PyResult<Py<PyAny>> {
        let ty = self.incoming.bind(py);
        // SAFETY: `ty` is a tuple subclass without fields of its own
        // (checked in `new`): its `tp_alloc` makes a tuple of 5 empty
        // slots, each filled once here, as `tuple.__new__` fills them.
        unsafe {
            let tp = ty.as_type_ptr();
            let alloc = (*tp).tp_alloc.unwrap_or(ffi::PyType_GenericAlloc);
            let obj = alloc(tp, 5);
            if obj.is_null() {
                return Err(PyErr::fetch(py));
            }
            for (i, item) in items.into_iter().enumerate() {
                ffi::PyTuple_SET_ITEM(obj, i as ffi::Py_ssize_t, item.into_ptr());
            }
            // Its items are atoms and untracked tuples (see `untracked`);
            // its type is a module's class, which outlives it.
            ffi::PyObject_GC_UnTrack(obj.cast());
            Ok(Py::from_owned_ptr(py, obj))
        }
    }
}

#[pymethods]
impl RecordReader {
    /// `incoming`: `core.Incoming`; `inflate(codec, data) -> bytes`
    /// decompresses a batch's records; `kind_header` and
    /// `origin_key_header`: what says a repartitioned record's kind and
    /// origin key (`read` with `pool=None`).
    #[new]
    #[pyo3(signature = (incoming, inflate, kind_header, origin_key_header, check_crc = true))]
    fn new(
        incoming: Bound<'_, PyType>,
        inflate: Py<PyAny>,
        kind_header: &str,
        origin_key_header: &str,
        check_crc: bool,
    ) -> PyResult<Self> {
        let py = incoming.py();
        let tuple = py.get_type::<PyTuple>();
        // SAFETY: reading the two type objects' sizes.
        let same_layout = unsafe {
            let (a, b) = (incoming.as_type_ptr(), tuple.as_type_ptr());
            (*a).tp_basicsize == (*b).tp_basicsize && (*a).tp_itemsize == (*b).tp_itemsize
        };
        if !incoming.is_subclass(tuple.as_any())? || !same_layout {
            return Err(PyTypeError::new_err("incoming must be a NamedTuple of 5 fields"));
        }
        Ok(RecordReader {
            incoming: incoming.unbind(),
            inflate,
            kind_header: kind_header.as_bytes().to_vec(),
            origin_key_header: origin_key_header.as_bytes().to_vec(),
            names: HashMap::new(),
            keys: HashMap::new(),
            check_crc,
        })
    }

    /// One partition's `records` bytes from `fetch_offset` on (see
    /// `read_partition`). `pool`: every record's `Incoming.pool`; None:
    /// repartitioned records, whose kind and key are in their headers.
    /// `data` is any contiguous buffer (bytes, or a memoryview of a
    /// fetch response's buffer), unchanged while it is read.
    #[pyo3(signature = (data, fetch_offset, pool, aborted = None, read_committed = true))]
    fn read(
        &mut self,
        py: Python<'_>,
        data: PyBuffer<u8>,
        fetch_offset: i64,
        pool: Option<bool>,
        aborted: Option<Vec<(i64, i64)>>,
        read_committed: bool,
    ) -> PyResult<Fetched> {
        let data = contiguous(&data)?;
        let inflate = self.inflate.clone_ref(py).into_bound(py);
        let mut calls = Calls { py, inflate: &inflate };
        let list = PyList::empty(py);
        let mut offsets = Vec::new();
        let mut timestamps = Vec::new();
        let check_crc = self.check_crc;
        let read = read_partition(
            data,
            fetch_offset,
            aborted.as_deref().unwrap_or_default(),
            read_committed,
            check_crc,
            &mut calls,
            |r, headers| -> PyResult<()> {
                let mut pairs = Vec::with_capacity(headers.len());
                let mut kind_pool = false;
                let mut origin_key: Option<&[u8]> = None;
                for h in headers {
                    pairs.push(self.pair(py, h)?.into_bound(py).into_any());
                    if pool.is_none() {
                        if h.key == self.kind_header {
                            kind_pool = h.value == Some(b"pool");
                        } else if h.key == self.origin_key_header {
                            origin_key = h.value;
                        }
                    }
                }
                let (is_pool, key) = match pool {
                    Some(p) => (p, r.key),
                    None => (kind_pool, origin_key),
                };
                let key = match key {
                    Some(k) => self.key(py, k).into_bound(py).into_any(),
                    None => py.None().into_bound(py),
                };
                let value = match r.value {
                    Some(v) => PyBytes::new(py, v).into_any(),
                    None => py.None().into_bound(py),
                };
                let items = [
                    pyo3::types::PyBool::new(py, is_pool).to_owned().into_any(),
                    key,
                    untracked(PyTuple::new(py, pairs)?).into_any(),
                    value,
                    PyFloat::new(py, r.timestamp as f64 / 1000.0).into_any(),
                ];
                list.append(self.incoming(py, items)?)?;
                offsets.push(r.offset);
                timestamps.push(r.timestamp);
                Ok(())
            },
        )?;
        Ok(Fetched {
            records: list.unbind(),
            offsets,
            timestamps,
            next_offset: read.next_offset,
            error: read.error.map(|e| e.to_string()),
        })
    }
}

fn contiguous(data: &PyBuffer<u8>) -> PyResult<&[u8]> {
    crate::buffer_bytes(data).ok_or_else(|| PyValueError::new_err("a contiguous buffer of bytes"))
}

/// One partition's answer in a Fetch response: (topic, partition,
/// error code, high watermark, last stable offset or None, aborted
/// transactions or None, where its records start and end in `data`).
type Answer = (Py<PyString>, i32, i16, i64, Option<i64>, Option<Vec<(i64, i64)>>, usize, usize);

/// The Fetch response of `version` in `data` from `offset` on (its
/// body, after the response header; see `parse_fetch_response`): its
/// own error code and its partitions' answers, their records left in
/// `data` (read them with `RecordReader.read` on a slice of it).
#[pyfunction]
pub fn fetch_response(py: Python<'_>, data: PyBuffer<u8>, offset: usize, version: i16) -> PyResult<(i16, Vec<Answer>)> {
    let bytes = contiguous(&data)?;
    let body = bytes.get(offset..).ok_or_else(|| PyValueError::new_err("offset past the response"))?;
    let answer = parse_fetch_response(body, version).map_err(PyValueError::new_err)?;
    let mut names: Vec<(&str, Py<PyString>)> = Vec::new();
    let mut out = Vec::with_capacity(answer.partitions.len());
    for p in answer.partitions {
        let name = match names.iter().find(|(n, _)| *n == p.topic) {
            Some((_, t)) => t.clone_ref(py),
            None => {
                let t = PyString::new(py, p.topic).unbind();
                names.push((p.topic, t.clone_ref(py)));
                t
            }
        };
        out.push((
            name,
            p.partition,
            p.error_code,
            p.high_watermark,
            p.last_stable_offset,
            p.aborted,
            offset + p.records.start,
            offset + p.records.end,
        ));
    }
    Ok((answer.error_code, out))
}

/// `crc32c(data)`, for the tests.
#[pyfunction(name = "crc32c")]
pub fn crc32c_py(data: &[u8]) -> u32 {
    crc32c(data)
}

/// Registers the edge in the kernel module.
pub fn register(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    use pyo3::prelude::*;
    m.add_class::<RecordReader>()?;
    m.add_class::<Fetched>()?;
    m.add_class::<Merged>()?;
    m.add_function(wrap_pyfunction!(merge_fetched, m)?)?;
    m.add_function(wrap_pyfunction!(fetch_response, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c_py, m)?)?;
    Ok(())
}
