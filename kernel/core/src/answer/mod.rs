//! The contract's answer shapes, written without Python. See README.md.

mod shape;

pub use shape::{Lengths, Shape};
