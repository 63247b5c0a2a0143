//! The engine payloads (contract section 2) read without Python, and the
//! msgpack token ids they carry. See README.md.

pub mod engine_wire;
mod msgpack;

pub use msgpack::msgpack_u32;
