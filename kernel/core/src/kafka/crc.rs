//! CRC-32C (Castagnoli), the checksum of Kafka's record batches.

const CASTAGNOLI: u32 = 0x82f6_3b78; // reflected

const fn crc_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ CASTAGNOLI } else { c >> 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC_TABLE: [u32; 256] = crc_table();

fn crc32c_table(crc: u32, data: &[u8]) -> u32 {
    data.iter().fold(crc, |c, &b| CRC_TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42_serial(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut c = u64::from(crc);
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        c = _mm_crc32_u64(c, u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let mut c = c as u32;
    for &b in words.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    c
}

/// Bytes each of the three interleaved CRCs covers a stride (see
/// `crc32c_sse42`).
const LANE: usize = 1024;

/// `crc32c_sse42_serial(c, [0; LANE])`, which is linear in `c`, as four
/// tables of its value on each byte of `c`.
#[cfg(target_arch = "x86_64")]
fn lane_shift() -> &'static [[u32; 256]; 4] {
    static SHIFT: std::sync::OnceLock<Box<[[u32; 256]; 4]>> = std::sync::OnceLock::new();
    SHIFT.get_or_init(|| {
        let zeros = [0u8; LANE];
        // SAFETY: only called from `crc32c_sse42`, which the CPU can run.
        let bit: Vec<u32> = (0..32).map(|i| unsafe { crc32c_sse42_serial(1 << i, &zeros) }).collect();
        let mut t = Box::new([[0u32; 256]; 4]);
        for (k, table) in t.iter_mut().enumerate() {
            for (b, slot) in table.iter_mut().enumerate() {
                *slot = (0..8).filter(|j| b >> j & 1 != 0).fold(0, |acc, j| acc ^ bit[8 * k + j]);
            }
        }
        t
    })
}

/// CRC-32C by the SSE 4.2 instruction. One chain of it waits three
/// cycles an instruction for the last; three independent chains over
/// three lanes of each stride keep the unit busy, and are joined by the
/// CRC's linearity: crc(c, A || B) = crc(c, zeros(|B|)) ^ crc(0, B).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::_mm_crc32_u64;
    if data.len() < 3 * LANE {
        return crc32c_sse42_serial(crc, data);
    }
    let shift = lane_shift();
    let by_shift = |c: u32| {
        let t = shift;
        t[0][(c & 0xff) as usize]
            ^ t[1][(c >> 8 & 0xff) as usize]
            ^ t[2][(c >> 16 & 0xff) as usize]
            ^ t[3][(c >> 24) as usize]
    };
    let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    let mut c = crc;
    let mut strides = data.chunks_exact(3 * LANE);
    for stride in &mut strides {
        let (a, rest) = stride.split_at(LANE);
        let (b, d) = rest.split_at(LANE);
        let (mut c0, mut c1, mut c2) = (u64::from(c), 0u64, 0u64);
        for i in (0..LANE).step_by(8) {
            c0 = _mm_crc32_u64(c0, word(a, i));
            c1 = _mm_crc32_u64(c1, word(b, i));
            c2 = _mm_crc32_u64(c2, word(d, i));
        }
        c = by_shift(by_shift(c0 as u32) ^ c1 as u32) ^ c2 as u32;
    }
    crc32c_sse42_serial(c, strides.remainder())
}

/// CRC-32C (Castagnoli), as Kafka's record batches carry it.
pub fn crc32c(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU has SSE 4.2, checked just above.
        return !unsafe { crc32c_sse42(!0, data) };
    }
    !crc32c_table(!0, data)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
