//! CRC-32C throughput of `kvconductor_core::kafka::crc32c`, by input size
//! (1.7 KB: a fleet record, docs/configuration.md). Not a test: run it with
//!
//!     cargo test --release -p kvconductor-core --test crc_bench -- --ignored --nocapture
//!
//! Each size: the same pseudo-random bytes, over enough calls for ~50 ms,
//! best of 7 rounds (the box is shared; the best round is the least
//! disturbed), as GB/s. Two ways: `independent`, calls whose inputs do not
//! wait on each other (the CPU overlaps consecutive calls, as it does a
//! fetch's batches, whose checks are only compared), and `dependent`, each
//! call's slice starting at an offset taken from the call before (a
//! call's whole latency).

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvconductor_core::kafka::crc32c;

fn data(n: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// Best of 7 rounds of `calls` calls, in seconds a call.
fn best(calls: usize, mut round: impl FnMut() -> u32) -> f64 {
    let mut best = Duration::MAX;
    for _ in 0..7 {
        let t = Instant::now();
        black_box(round());
        best = best.min(t.elapsed());
    }
    best.as_secs_f64() / calls as f64
}

#[test]
#[ignore = "a benchmark: run with --release -- --ignored --nocapture"]
fn crc32c_throughput() {
    let sizes = [64, 512, 1_700, 4_096, 16_384, 65_536, 1 << 20];
    println!("{:>9} {:>12} {:>12} {:>12}", "bytes", "indep GB/s", "dep GB/s", "dep ns/call");
    for n in sizes {
        let bytes = data(n + 2);
        let calls = (50_000_000 / n).max(1);
        // From byte 1: a record's bytes are not aligned.
        let independent = best(calls, || {
            let mut acc = 0u32;
            for _ in 0..calls {
                acc ^= crc32c(black_box(&bytes[1..=n]));
            }
            acc
        });
        // From byte 1 or 2, as the last CRC says: each call waits for the one before.
        let dependent = best(calls, || {
            let mut acc = 0u32;
            for _ in 0..calls {
                let at = 1 + (acc & 1) as usize;
                acc = crc32c(&bytes[at..at + n]);
            }
            acc
        });
        println!(
            "{:>9} {:>12.1} {:>12.1} {:>12.1}",
            n,
            n as f64 / independent / 1e9,
            n as f64 / dependent / 1e9,
            dependent * 1e9
        );
    }
}
