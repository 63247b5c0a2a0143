//! The maps against std's, under random sequences of operations: small key
//! ranges so that runs collide, wrap and shift back on removal; one case
//! of each past `SPLIT_AT` keys, where a map becomes `SHARDS` tables.

use std::collections::{HashMap, HashSet};

use kvconductor_core::maps::table::SPLIT_AT;
use kvconductor_core::maps::{CountMap, SeqSet, ShardedMap, Vacant};
use proptest::prelude::*;

/// Keys from a few values (collisions, key 0) or anywhere in u64.
fn key() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..64, any::<u64>()]
}

#[derive(Debug, Clone)]
enum CountOp {
    Increment(u64),
    Decrement(u64),
    Or(u64, u64),
    ClearBits(u64, u64),
    Reserve(usize),
}

fn count_op() -> impl Strategy<Value = CountOp> {
    prop_oneof![
        3 => key().prop_map(CountOp::Increment),
        2 => key().prop_map(CountOp::Decrement),
        2 => (key(), 1u64..16).prop_map(|(k, b)| CountOp::Or(k, b)),
        2 => (key(), 0u64..16).prop_map(|(k, b)| CountOp::ClearBits(k, b)),
        1 => (0usize..200).prop_map(CountOp::Reserve),
    ]
}

fn check_count(map: &CountMap, reference: &HashMap<u64, u64>) {
    assert_eq!(map.is_empty(), reference.is_empty());
    for (&k, &v) in reference {
        assert_eq!(map.get(k), v);
        assert!(map.contains(k));
    }
    let mut listed: Vec<(u64, u64)> = map.iter().collect();
    listed.sort_unstable();
    let mut want: Vec<(u64, u64)> = reference.iter().map(|(&k, &v)| (k, v)).collect();
    want.sort_unstable();
    assert_eq!(listed, want);
}

/// `CountMap`'s values as std's map keeps them, a key leaving at 0.
fn apply_count(map: &mut CountMap, reference: &mut HashMap<u64, u64>, op: &CountOp) {
    match *op {
        CountOp::Increment(k) => {
            map.increment(k);
            *reference.entry(k).or_insert(0) += 1;
        }
        CountOp::Decrement(k) => {
            // Only a held count is taken from (the store never goes below 0).
            if let Some(v) = reference.get_mut(&k) {
                map.decrement(k);
                *v -= 1;
                if *v == 0 {
                    reference.remove(&k);
                }
            } else {
                map.decrement(k); // absent: nothing happens
            }
        }
        CountOp::Or(k, b) => {
            let before = reference.get(&k).copied().unwrap_or(0);
            assert_eq!(map.or(k, b), before);
            reference.insert(k, before | b);
        }
        CountOp::ClearBits(k, b) => {
            map.clear_bits(k, b);
            if let Some(v) = reference.get_mut(&k) {
                *v &= !b;
                if *v == 0 {
                    reference.remove(&k);
                }
            }
        }
        CountOp::Reserve(n) => map.reserve(n),
    }
    assert_eq!(map.get(op_key(op)), reference.get(&op_key(op)).copied().unwrap_or(0));
}

fn op_key(op: &CountOp) -> u64 {
    match *op {
        CountOp::Increment(k) | CountOp::Decrement(k) | CountOp::Or(k, _) | CountOp::ClearBits(k, _) => k,
        CountOp::Reserve(_) => 0,
    }
}

/// Any u64 but `u64::MAX`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct V(u64);

impl Vacant for V {
    const VACANT: Self = V(u64::MAX);
    fn is_vacant(&self) -> bool {
        self.0 == u64::MAX
    }
}

#[derive(Debug, Clone)]
enum MapOp {
    Insert(u64, u64),
    Remove(u64),
    Set(u64, u64),
    Reserve(usize),
}

fn map_op() -> impl Strategy<Value = MapOp> {
    prop_oneof![
        4 => (key(), 0u64..1000).prop_map(|(k, v)| MapOp::Insert(k, v)),
        3 => key().prop_map(MapOp::Remove),
        2 => (key(), 0u64..1000).prop_map(|(k, v)| MapOp::Set(k, v)),
        1 => (0usize..200).prop_map(MapOp::Reserve),
    ]
}

fn apply_map(map: &mut ShardedMap<V>, reference: &mut HashMap<u64, u64>, op: &MapOp) {
    match *op {
        MapOp::Insert(k, v) => {
            let (got, inserted) = map.get_or_insert_with(k, || V(v));
            assert_eq!(inserted, !reference.contains_key(&k));
            let want = *reference.entry(k).or_insert(v);
            assert_eq!(*got, V(want));
        }
        MapOp::Remove(k) => assert_eq!(map.remove(&k), reference.remove(&k).map(V)),
        MapOp::Set(k, v) => {
            if let Some(got) = map.get_mut(&k) {
                *got = V(v);
            }
            if let Some(want) = reference.get_mut(&k) {
                *want = v;
            }
        }
        MapOp::Reserve(n) => map.reserve(n),
    }
}

fn check_map(map: &ShardedMap<V>, reference: &HashMap<u64, u64>) {
    assert_eq!(map.len(), reference.len());
    for (k, v) in reference {
        assert_eq!(map.get(k), Some(&V(*v)));
        assert!(map.contains_key(k));
    }
    let mut listed: Vec<(u64, u64)> = map.iter().map(|(k, v)| (*k, v.0)).collect();
    listed.sort_unstable();
    let mut want: Vec<(u64, u64)> = reference.iter().map(|(&k, &v)| (k, v)).collect();
    want.sort_unstable();
    assert_eq!(listed, want);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn count_map_is_a_map_of_non_zero_counts(ops in prop::collection::vec(count_op(), 0..400)) {
        let mut map = CountMap::default();
        let mut reference = HashMap::new();
        for op in &ops {
            apply_count(&mut map, &mut reference, op);
        }
        check_count(&map, &reference);
    }

    #[test]
    fn sharded_map_is_a_hash_map(ops in prop::collection::vec(map_op(), 0..400)) {
        let mut map: ShardedMap<V> = ShardedMap::default();
        let mut reference = HashMap::new();
        for op in &ops {
            apply_map(&mut map, &mut reference, op);
        }
        check_map(&map, &reference);
    }

    #[test]
    fn seq_set_is_a_hash_set(ops in prop::collection::vec((any::<bool>(), key()), 0..400)) {
        let mut set = SeqSet::default();
        let mut reference = HashSet::new();
        for &(insert, k) in &ops {
            if insert {
                prop_assert_eq!(set.insert(k), reference.insert(k));
            } else {
                prop_assert_eq!(set.remove(&k), reference.remove(&k));
            }
            prop_assert_eq!(set.contains(&k), reference.contains(&k));
        }
        prop_assert_eq!(set.len(), reference.len());
        prop_assert_eq!(set.is_empty(), reference.is_empty());
        let mut listed: Vec<u64> = set.iter().copied().collect();
        listed.sort_unstable();
        let mut want: Vec<u64> = reference.into_iter().collect();
        want.sort_unstable();
        prop_assert_eq!(listed, want);
    }
}

proptest! {
    // Each case inserts past the split: a few cases only.
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]

    #[test]
    fn maps_keep_every_key_across_the_split(
        seed in any::<u64>(),
        ops in prop::collection::vec(count_op(), 0..200),
        map_ops in prop::collection::vec(map_op(), 0..200),
    ) {
        let mut counts = CountMap::default();
        let mut count_ref = HashMap::new();
        let mut map: ShardedMap<V> = ShardedMap::default();
        let mut map_ref = HashMap::new();
        let mut set = SeqSet::default();
        let mut set_ref = HashSet::new();
        for i in 0..SPLIT_AT as u64 + 1000 {
            let k = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            apply_count(&mut counts, &mut count_ref, &CountOp::Increment(k));
            apply_map(&mut map, &mut map_ref, &MapOp::Insert(k, i % 1000));
            set.insert(k);
            set_ref.insert(k);
        }
        for op in &ops {
            apply_count(&mut counts, &mut count_ref, op);
        }
        for op in &map_ops {
            apply_map(&mut map, &mut map_ref, op);
        }
        check_count(&counts, &count_ref);
        check_map(&map, &map_ref);
        prop_assert_eq!(set.len(), set_ref.len());
        for k in &set_ref {
            prop_assert!(set.contains(k));
        }
    }
}
