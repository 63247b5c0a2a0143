//! The engine payloads (contract section 2) read without Python, and the
//! msgpack token ids they carry, and a decoded record applied to its
//! owner in a store (`apply`). See README.md.

pub mod apply;
pub mod engine_wire;
mod msgpack;

pub use msgpack::msgpack_u32;
