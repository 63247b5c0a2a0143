//! A decoded engine record applied to its owner without Python: whole or
//! not at all (tests/test_engine_lane.py holds the lane to the Python path).

use std::convert::Infallible;

use kvconductor_core::ingest::apply::{Rules, Tally, Work};
use kvconductor_core::ingest::engine_wire::{Event, Extra, Removed, Stored};
use kvconductor_core::store::{Prompt, Store, DEVICE, HOST};

const RULES: Rules<'static> =
    Rules { slot: 0, block_size: 2, seed: 7, max_blocks: 100, pool_mode: false, reannounces: true, kind0: None };

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Event<'static> {
    Event::Stored(Stored {
        hashes: hashes.to_vec(),
        parent,
        tokens: Some(tokens.iter().flat_map(|t| t.to_le_bytes()).collect()),
        block_size: None,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra: Extra::None,
        group_idx: None,
        kind: None,
    })
}

fn removed(hashes: &[u64]) -> Event<'static> {
    Event::Removed(Removed { hashes: hashes.to_vec(), medium: None, group_idx: None })
}

fn apply(work: &mut Work, s: &mut Store, events: &[Event<'_>], tiers: &[usize]) -> Option<(usize, [u64; 3], u8)> {
    let mut now = 0.0;
    let applied = work.apply::<Infallible>(&RULES, s, None, 1.0, events, tiers, &mut now).unwrap();
    applied.map(|a| (a.blocks, a.per_tier, a.stored))
}

#[test]
fn a_record_applies_whole_or_not_at_all() {
    let mut s = Store::new(100, 60.0);
    s.add_owner(0).unwrap();
    let mut work = Work::default();
    // Two blocks of two tokens, chained from the seed: the walk finds them.
    assert_eq!(apply(&mut work, &mut s, &[stored(&[1, 2], None, &[5, 6, 7, 8])], &[DEVICE]), Some((2, [2, 0, 0], 1)));
    let data: Vec<u8> = [5u32, 6, 7, 8].iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut prompt = Prompt::tokens(&data, 2, 7).unwrap();
    let found = match s.matched(&mut prompt, &[1]) {
        Ok(f) => f,
        Err(never) => match never {},
    };
    assert_eq!(found, [(0, 2, 2, 2)]);
    // A store hung from a parent nobody holds is the Python path's: the
    // removal before it in the same record is undone.
    let record = [removed(&[2]), stored(&[9], Some(42), &[1, 2])];
    assert_eq!(apply(&mut work, &mut s, &record, &[DEVICE, DEVICE]), None);
    assert_eq!(s.tier_len(0, DEVICE), Ok(2));
    // A removal of a hash not held is counted, the rest applies.
    assert_eq!(apply(&mut work, &mut s, &[removed(&[2, 3])], &[DEVICE]), Some((1, [0, 0, 0], 0)));
    assert_eq!(work.tally, Tally { hash_conflicts: 0, removal_unknown: 1 });
    // An emptied owner leaves its namespace: the Python path's.
    assert_eq!(apply(&mut work, &mut s, &[removed(&[1])], &[DEVICE]), None);
    assert_eq!(s.tier_len(0, DEVICE), Ok(1));
    // A re-announcement changes nothing; a copy to the host tier is applied there.
    assert_eq!(apply(&mut work, &mut s, &[stored(&[1], None, &[5, 6])], &[DEVICE]), Some((0, [0, 0, 0], 1)));
    assert_eq!(apply(&mut work, &mut s, &[stored(&[1], None, &[5, 6])], &[HOST]), Some((1, [0, 1, 0], 2)));
    // Where the engine does not declare that it re-announces, the same
    // store is a copy: the Python path's.
    let incremental = Rules { reannounces: false, ..RULES };
    let mut now = 0.0;
    let events = [stored(&[1], None, &[5, 6])];
    let applied = work.apply::<Infallible>(&incremental, &mut s, None, 1.0, &events, &[DEVICE], &mut now).unwrap();
    assert!(applied.is_none());
}
