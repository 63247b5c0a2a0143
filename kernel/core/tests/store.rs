//! `Store` without Python: the calls `BlockStore` makes, their errors, and
//! the walk. tests/test_block_store.py holds the store to `PyBlockStore`
//! call for call; these pin the core's own API.

use kvconductor_core::store::{Error, Prompt, Store, DEVICE, DISK, HOST, MAX_SLOTS};

fn walk(store: &Store, idents: &[u64], listed: &[u64]) -> Vec<(usize, u32, u32, u32)> {
    let mut prompt = Prompt::given(idents.to_vec());
    match store.matched(&mut prompt, listed) {
        Ok(found) => found,
        Err(never) => match never {},
    }
}

#[test]
fn placed_blocks_match_and_removed_ones_retire() {
    let mut s = Store::new(100, 60.0);
    s.add_owner(0).unwrap();
    s.add_owner(65).unwrap();
    assert_eq!(s.place_owner(0, DEVICE, &[1, 2, 3], Some(&[10, 20, 30]), i64::MAX), Ok((3, 0, 0, vec![])));
    assert_eq!(s.place_owner(65, HOST, &[1, 2], None, i64::MAX), Ok((2, 0, 0, vec![])));
    assert_eq!(s.owner_size(0), Ok(3));
    assert_eq!(s.tier_len(65, HOST), Ok(2));
    assert_eq!(s.content_len(), 3);
    // Slot 0 on the device for three blocks; slot 65 (word 1, bit 1) on the host for two.
    assert_eq!(walk(&s, &[10, 20, 30, 40], &[1, 2]), vec![(0, 3, 3, 3), (65, 0, 2, 2)]);
    assert_eq!(s.remove_owner(0, DEVICE, &[3, 4]), Ok(vec![4]));
    assert_eq!(s.retired_len(), 1);
    assert_eq!(s.export_retired().iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(), [(3, 30)]);
    s.expire(61.0);
    assert_eq!(s.retired_len(), 0);
    assert_eq!(s.ident(3), None);
    assert_eq!(s.clear_owner(0), Ok(2));
    assert_eq!(s.retired_len(), 0, "slot 65 still holds 1 and 2");
    assert_eq!(s.clear_owner(65), Ok(2));
    assert_eq!(s.retired_len(), 2);
}

#[test]
fn room_and_conflicts() {
    let mut s = Store::new(100, 60.0);
    s.add_owner(0).unwrap();
    s.add_owner(1).unwrap();
    assert_eq!(s.place_owner(0, DEVICE, &[1, 2, 3], Some(&[10, 20, 30]), 1), Ok((1, 2, 0, vec![])));
    // Hash 1 is known with identity 10: another identity is a conflict, the first stays.
    assert_eq!(s.place_owner(1, DEVICE, &[1], Some(&[99]), i64::MAX), Ok((1, 0, 1, vec![])));
    assert_eq!(s.ident(1), Some(10));
    // Unknown hashes wait when no identity is given.
    assert_eq!(s.place_owner(1, DISK, &[1, 7], None, i64::MAX), Ok((1, 0, 0, vec![7])));
}

#[test]
fn pools_report_what_they_placed() {
    let mut s = Store::new(100, 60.0);
    s.add_pool(5, HOST).unwrap();
    let mut out = Vec::new();
    assert_eq!(s.place_pool(5, &[1, 2], Some(&[10, 20]), i64::MAX, Some(&mut out)), Ok((2, 0, 0, vec![])));
    assert_eq!(out, [1, 2]);
    assert!(s.pool_holds(10));
    assert_eq!(s.remove_pool(5, 1), Ok(true));
    assert!(!s.pool_holds(10));
    assert_eq!(s.export_pool(5), Ok((vec![2], vec![20])));
}

#[test]
fn every_refusal_is_its_error() {
    let mut s = Store::new(100, 60.0);
    assert_eq!(s.release(1), Err(Error::NotHeld(1)));
    assert_eq!(s.add_owner(MAX_SLOTS), Err(Error::SlotOutOfRange));
    assert_eq!(s.owner_size(3), Err(Error::NoOwner(3)));
    assert_eq!(s.pool_len(-1), Err(Error::NoPool(-1)));
    s.add_owner(0).unwrap();
    assert_eq!(s.tier_len(0, 3), Err(Error::TierOutOfRange));
    assert_eq!(s.place_owner(0, DEVICE, &[1, 2], Some(&[10]), i64::MAX), Err(Error::FewerIdentities));
    assert_eq!(s.load_owner(0, DEVICE, &[0; 8], &[]), Err(Error::CountsDiffer("tier")));
    assert_eq!(s.load_owner(0, DEVICE, &[0; 7], &[]), Err(Error::BadBytes));
    assert_eq!(s.load_owner(0, DEVICE, &[2; 8], &[3; 8]), Err(Error::NotEmpty("tier")));
    assert_eq!(s.end_cut(), Err(Error::EndCutWithoutBegin));
    assert_eq!(s.freeze_owner(0), Err(Error::NoCutOpen));
    assert_eq!(s.cut_identities(&[]), Err(Error::NoCutOpen));
    s.begin_cut();
    assert_eq!(s.cut_owner_seqs(0, DEVICE), Err(Error::TierNotFrozen));
    assert_eq!(s.cut_pool_seqs(1), Err(Error::PoolNotFrozen));
    assert_eq!(s.cut_identities(&5u64.to_le_bytes()), Err(Error::Unknown(5)));
    assert_eq!(s.load_retired(&[0; 8], &[], &[]), Err(Error::RetiredLengths));
    assert!(Prompt::tokens(&[], 0, 0).is_err());
    assert_eq!(Error::CountsDiffer("pool").to_string(), "a pool's hashes and identities differ in count");
}

#[test]
fn a_cut_keeps_what_changed_after_it() {
    let mut s = Store::new(100, 60.0);
    s.add_owner(0).unwrap();
    s.place_owner(0, DEVICE, &[1, 2], Some(&[10, 20]), i64::MAX).unwrap();
    s.begin_cut();
    s.freeze_owner(0).unwrap();
    s.remove_owner(0, DEVICE, &[1]).unwrap();
    s.clear_retired();
    let mut seqs = s.cut_owner_seqs(0, DEVICE).unwrap();
    seqs.sort_unstable();
    assert_eq!(seqs, [1, 2], "the tier as it was at the cut");
    let bytes: Vec<u8> = [1u64, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(s.cut_identities(&bytes), Ok(vec![10, 20]), "forgotten after the cut, still known to it");
    s.end_cut().unwrap();
}
