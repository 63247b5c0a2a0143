//! The Python edge of `kvconductor_core::query`.

use kvconductor_core::query::TokenQuery;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

type Read<'py> = (String, i128, Bound<'py, PyBytes>, Option<String>, Option<String>, Option<String>, Option<String>);

/// `kvconductor.wire.query.read_token_query`: a `POST /query` body's
/// fields, or None for the API's msgspec decoder to answer.
#[pyfunction]
pub fn read_token_query<'py>(py: Python<'py>, body: &[u8]) -> Option<Read<'py>> {
    let q: TokenQuery = kvconductor_core::query::read_token_query(body)?;
    Some((q.model, q.block_size, PyBytes::new(py, &q.token_ids), q.lora_name, q.tenant_id, q.instance_id, q.cache_salt))
}
