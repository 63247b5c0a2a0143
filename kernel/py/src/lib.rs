//! Compiled kernels for kvconductor's hot paths (see `kvconductor/kernel.py`):
//! a namespace's block store (`store`, with the query's tier walk), the
//! query answer's shape (`shape`) and
//! `kvconductor.wire.hashing`'s prompt packing and chain hashing
//! (`identity_i = xxh3_64(block_i, seed = identity_{i-1})`). Both paths must
//! give the pure-Python ones' answers (tests/test_kernel.py,
//! tests/test_block_store.py).
//!
//! The only crate on PyO3: what needs no interpreter is in
//! `kvconductor_core` (kernel/core), and this crate is its Python edge,
//! with the parts still mixed with PyO3 (`lane`; see
//! docs/architecture.md, "The compiled kernel").

mod groups;
mod lane;
mod query;
mod record_batch;
mod shape;
mod small_int;
mod store;

use std::os::raw::c_ulong;

use kvconductor_core::ingest::msgpack_u32;
use pyo3::buffer::PyBuffer;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// `kvconductor.wire.hashing.chain_identities` without extra keys.
#[pyfunction]
fn chain_identities(data: &[u8], n_blocks: usize, block_size: usize, parent: u64) -> PyResult<Vec<u64>> {
    let step = block_size * 4;
    if step == 0 || n_blocks.checked_mul(step).is_none_or(|n| n > data.len()) {
        return Err(pyo3::exceptions::PyValueError::new_err("fewer token bytes than blocks"));
    }
    let mut ident = parent;
    Ok(data[..n_blocks * step]
        .chunks_exact(step)
        .map(|block| {
            ident = xxh3_64_with_seed(block, ident);
            ident
        })
        .collect())
}

/// `kvconductor.wire.hashing.pack_tokens`: token ids as little-endian u32.
/// OverflowError outside u32, TypeError for a non-integer, like `array`.
#[pyfunction]
fn pack_tokens<'py>(py: Python<'py>, tokens: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    fn push(out: &mut Vec<u8>, item: &Bound<'_, PyAny>) -> PyResult<()> {
        out.extend_from_slice(&item.extract::<u32>()?.to_le_bytes());
        Ok(())
    }
    let mut out: Vec<u8> = Vec::new();
    if let Ok(list) = tokens.cast::<PyList>() {
        if let Some(packed) = pack_small_ints(py, list)? {
            return Ok(packed);
        }
        // Some item is not a small int. Still read them in place, without
        // an iterator's reference counting (half the time of `extract` each).
        out.reserve(list.len() * 4);
        let mut i = 0;
        // The length is read each time: `extract` below may run Python code.
        while i < list.len() {
            // SAFETY: `i` is in bounds, and `PyLong_AsUnsignedLong` runs no
            // Python code (for a non-int it only raises TypeError).
            let item = unsafe { ffi::PyList_GET_ITEM(list.as_ptr(), i as ffi::Py_ssize_t) };
            let value = unsafe { ffi::PyLong_AsUnsignedLong(item) };
            match u32::try_from(value) {
                Ok(token) if value != c_ulong::MAX => out.extend_from_slice(&token.to_le_bytes()),
                _ => {
                    // Out of range, or not an int: `extract` says which (and
                    // takes what `__index__` makes an int, like numpy's).
                    drop(PyErr::take(py));
                    push(&mut out, &list.get_item(i)?)?;
                }
            }
            i += 1;
        }
    } else {
        for item in tokens.try_iter()? {
            push(&mut out, &item?)?;
        }
    }
    Ok(PyBytes::new(py, &out))
}

/// `n` tokens, the `i`th from `token(i)`, written straight into a bytes
/// object as little-endian u32: no buffer to grow and copy (a 32 KB malloc
/// and memcpy a query). None as soon as `token` gives None.
fn packed_tokens<'py>(
    py: Python<'py>,
    n: usize,
    mut token: impl FnMut(usize) -> Option<u32>,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let mut all_read = true;
    let packed = PyBytes::new_with(py, n * 4, |buf| {
        for (i, out) in buf.chunks_exact_mut(4).enumerate() {
            match token(i) {
                Some(t) => out.copy_from_slice(&t.to_le_bytes()),
                None => {
                    all_read = false;
                    break;
                }
            }
        }
        Ok(())
    })?;
    Ok(all_read.then_some(packed))
}

/// A list of small ints (a prompt's usual form) packed; None as soon as an
/// item is anything else.
fn pack_small_ints<'py>(py: Python<'py>, list: &Bound<'py, PyList>) -> PyResult<Option<Bound<'py, PyBytes>>> {
    // SAFETY: a list's items are `ob_item[..len]`, and nothing here runs
    // Python code, so the list keeps its items throughout.
    let items = unsafe { (*list.as_ptr().cast::<ffi::PyListObject>()).ob_item };
    packed_tokens(py, list.len(), |i| unsafe { small_int::read(*items.add(i)) })
}

/// `kvconductor.wire.hashing.tokens_from_msgpack`: one msgpack array of token ids
/// in [0, 2**32), exactly, as little-endian u32; None for anything else
/// (the decoder's slow path then says what is wrong). Read straight into
/// the bytes object: collecting a vector first grew it by doubling and
/// copied it twice (~4% of applying engine events).
#[pyfunction]
fn msgpack_tokens<'py>(py: Python<'py>, raw: PyBuffer<u8>) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let Some(mut rd) = buffer_bytes(&raw) else { return Ok(None) };
    let Some(n) = rmp::decode::read_array_len(&mut rd).ok().map(|n| n as usize) else { return Ok(None) };
    if n > rd.len() {
        return Ok(None); // every element takes at least a byte
    }
    let packed = packed_tokens(py, n, |_| msgpack_u32(&mut rd))?;
    Ok(packed.filter(|_| rd.is_empty()))
}

/// `kvconductor.wire.hashing.tokens_from_json`: one JSON array of token ids in
/// [0, 2**32), as little-endian u32; None for anything else (the query
/// API's typed decoder then says what is wrong).
#[pyfunction]
fn json_tokens<'py>(py: Python<'py>, raw: PyBuffer<u8>) -> Option<Bound<'py, PyBytes>> {
    Some(PyBytes::new(py, &kvconductor_core::query::json_tokens(buffer_bytes(&raw)?)?))
}

/// The bytes of a contiguous buffer (a msgspec.Raw, bytes, or a fetch
/// response's buffer), or None.
pub(crate) fn buffer_bytes(raw: &PyBuffer<u8>) -> Option<&[u8]> {
    if !raw.is_c_contiguous() {
        return None;
    }
    // SAFETY: `len_bytes` contiguous bytes that stay alive and unchanged
    // while the buffer is held (msgspec.Raw and bytes are immutable; the
    // fetcher writes a response's buffer only before it reads it).
    Some(unsafe { std::slice::from_raw_parts(raw.buf_ptr() as *const u8, raw.len_bytes()) })
}

#[pymodule]
fn _kernel(m: &Bound<'_, PyModule>) -> PyResult<()> {
    small_int::init(m.py())?;
    m.add_class::<store::BlockStore>()?;
    m.add_class::<shape::AnswerShape>()?;
    m.add_class::<lane::EngineLane>()?;
    record_batch::register(m)?;
    groups::register(m)?;
    m.add_function(wrap_pyfunction!(chain_identities, m)?)?;
    m.add_function(wrap_pyfunction!(pack_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(msgpack_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(json_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(query::read_token_query, m)?)?;
    Ok(())
}
