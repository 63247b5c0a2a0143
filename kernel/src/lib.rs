//! Compiled kernels for kvconductor's hot paths (see `kvconductor/kernel.py`):
//! a namespace's block store (`store`, with the query's tier walk) and
//! `kvconductor.hashing`'s prompt packing and chain hashing
//! (`identity_i = xxh3_64(block_i, seed = identity_{i-1})`). Both paths must
//! give the pure-Python ones' answers (tests/test_kernel.py,
//! tests/test_block_store.py).

mod store;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// `kvconductor.hashing.chain_identities` without extra keys.
#[pyfunction]
fn chain_identities(
    data: &[u8],
    n_blocks: usize,
    block_size: usize,
    parent: u64,
) -> PyResult<Vec<u64>> {
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

/// `kvconductor.hashing.pack_tokens`: token ids as little-endian u32.
/// OverflowError outside u32, TypeError for a non-integer, like `array`.
#[pyfunction]
fn pack_tokens<'py>(py: Python<'py>, tokens: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    fn push(out: &mut Vec<u8>, item: &Bound<'_, PyAny>) -> PyResult<()> {
        out.extend_from_slice(&item.extract::<u32>()?.to_le_bytes());
        Ok(())
    }
    let mut out: Vec<u8> = Vec::new();
    if let Ok(list) = tokens.cast::<PyList>() {
        out.reserve(list.len() * 4);
        for item in list.iter() {
            push(&mut out, &item)?;
        }
    } else {
        for item in tokens.try_iter()? {
            push(&mut out, &item?)?;
        }
    }
    Ok(PyBytes::new(py, &out))
}

#[pymodule]
fn _kernel(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::BlockStore>()?;
    m.add_function(wrap_pyfunction!(chain_identities, m)?)?;
    m.add_function(wrap_pyfunction!(pack_tokens, m)?)?;
    Ok(())
}
