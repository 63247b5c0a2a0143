//! Kafka's wire: record batches (magic 2) and fetch responses read in
//! place, and the batches' CRC-32C. See README.md.

mod crc;
mod record_batch;

pub use crc::crc32c;
pub use record_batch::*;
