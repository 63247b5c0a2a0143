//! kvconductor's compiled kernel without Python: the parts of the kernel
//! that need no interpreter, each a folder with a README of its
//! trade-offs. `kernel/py` is the only crate that speaks PyO3; it wraps
//! these in the `kvconductor._kernel` module.
//!
//! - `answer`: the answer's shape, laid out once per change of owners, and
//!   its JSON.
//! - `groups`: the non-primary KV-cache groups of hybrid models and vLLM's
//!   hit over them.
//! - `maps`: the u64-keyed tables the store is made of.
//! - `kafka`: record batches and fetch responses read in place, CRC-32C.
//! - `ingest`: the engine payloads real engines send, decoded.
//! - `query`: a `/query` body's fields and prompt.
//! - `store`: a namespace's blocks (`BlockStore`'s logic), the query's walk
//!   and the engine lane's view of one owner.

pub mod answer;
pub mod groups;
pub mod ingest;
pub mod kafka;
pub mod maps;
pub mod query;
pub mod store;
