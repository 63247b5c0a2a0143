//! `kvconductor.query_wire.read_token_query`, compiled: a `POST /query`
//! body read in one pass, its tokens packed as they are parsed. Only what
//! is plainly valid is taken; anything else (a wrong type, a duplicate or
//! missing field, a token outside u32, not an object) gives None and the
//! API's msgspec decoder answers it, with its exact errors.

use std::fmt;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use serde::de::{Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

/// `kvconductor.query_wire.TokenQuery`'s fields, the tokens packed.
#[derive(Deserialize)]
struct TokenQuery {
    model: String,
    /// Any integer msgspec reads as an `int` (i64 or u64); the index says
    /// whether it is a block size.
    block_size: serde_json::Number,
    #[serde(deserialize_with = "packed_tokens")]
    token_ids: Vec<u8>,
    lora_name: Option<String>,
    tenant_id: Option<String>,
    instance_id: Option<String>,
    cache_salt: Option<String>,
}

/// A JSON array of token ids as little-endian u32 bytes.
fn packed_tokens<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    struct Packed;
    impl<'de> Visitor<'de> for Packed {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an array of token ids in [0, 2**32)")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0) * 4);
            while let Some(token) = seq.next_element::<u32>()? {
                out.extend_from_slice(&token.to_le_bytes());
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Packed)
}

type Read<'py> = (
    String,
    i128,
    Bound<'py, PyBytes>,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

#[pyfunction]
pub fn read_token_query<'py>(py: Python<'py>, body: &[u8]) -> Option<Read<'py>> {
    // serde also reads a struct from an array of its fields; the API does not.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    let q: TokenQuery = serde_json::from_slice(body).ok()?;
    let block_size = match (q.block_size.as_i64(), q.block_size.as_u64()) {
        (Some(n), _) => i128::from(n),
        (None, Some(n)) => i128::from(n),
        _ => return None, // a float: the typed decoder says no
    };
    let tokens = PyBytes::new(py, &q.token_ids);
    Some((q.model, block_size, tokens, q.lora_name, q.tenant_id, q.instance_id, q.cache_salt))
}
