//! CRC-32C (Castagnoli), the checksum of Kafka's record batches, by the
//! `crc-fast` crate (`Crc32Iscsi`: the same polynomial, reflected, init and
//! final xor all ones). It picks its kernel at run time (carry-less
//! multiplication folded with the CRC32 instruction on x86_64 and aarch64,
//! a table elsewhere). Before it the kernel had its own: three interleaved
//! SSE 4.2 lanes joined by linearity, slower at every size measured
//! (README.md).

use crc_fast::{checksum, CrcAlgorithm};

/// CRC-32C (Castagnoli), as Kafka's record batches carry it.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    // A 32-bit CRC in the low bits of the crate's u64.
    checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CASTAGNOLI: u32 = 0x82f6_3b78; // reflected

    /// The reference: a byte at a time by a 256-entry table.
    fn crc32c_table(crc: u32, data: &[u8]) -> u32 {
        let table: Vec<u32> = (0..256u32)
            .map(|i| (0..8).fold(i, |c, _| if c & 1 != 0 { (c >> 1) ^ CASTAGNOLI } else { c >> 1 }))
            .collect();
        data.iter().fold(crc, |c, &b| table[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8))
    }

    #[test]
    fn the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn crc32c_known_answers() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        let long: Vec<u8> = (0..40_000u32).map(|i| (i * 7 + (i >> 9)) as u8).collect();
        for n in [0, 1, 7, 1000, 3071, 3072, 3073, 3080, 6144, 10_000, 40_000] {
            assert_eq!(crc32c(&long[..n]), !crc32c_table(!0, &long[..n]), "{n} bytes");
            assert_eq!(crc32c(&long[5..n.max(5)]), !crc32c_table(!0, &long[5..n.max(5)]), "{n} bytes, unaligned");
        }
    }

    proptest! {
        /// Any bytes at any alignment: the table's answer.
        #[test]
        fn crc32c_is_the_table_s(data in prop::collection::vec(any::<u8>(), 0..5000), skip in 0usize..16) {
            let data = &data[skip.min(data.len())..];
            prop_assert_eq!(crc32c(data), !crc32c_table(!0, data));
        }
    }
}
