//! `Shape` without Python: rows in name order, the best rank, and the JSON
//! (tests/test_answer_shape.py holds the compiled shape to the Python one).

use kvconductor_core::answer::{Lengths, Shape};

fn utf32(name: &str) -> Vec<u8> {
    name.chars().flat_map(|c| (c as u32).to_be_bytes()).collect()
}

fn shape() -> Shape<String, String> {
    let mut s = Shape::new(b"\"t\"".to_vec(), 16);
    for (name, ranks) in [("b", vec![(0, 0), (1, 1)]), ("a", vec![(0, 2)]), ("c", vec![(0, 3)])] {
        let json = format!("\"{name}\"").into_bytes();
        s.set_instance(utf32(name), name.to_string(), json, ranks, |r| r.to_string());
    }
    s
}

/// A row: name, best lengths, `DP` key and lengths per listed rank.
type Row = (String, Lengths, Vec<(String, Lengths)>);

fn rows(s: &mut Shape<String, String>, listed: Vec<(usize, Lengths)>) -> Vec<Row> {
    let mut out = Vec::new();
    s.rows(listed, |name, best, dp| {
        out.push((name.clone(), best, dp.map(|(k, m)| (k.clone(), m)).collect()));
        Ok::<(), ()>(())
    })
    .unwrap();
    out
}

#[test]
fn rows_come_in_name_order_with_the_best_rank() {
    let mut s = shape();
    assert_eq!(s.instances(), 3);
    let got = rows(&mut s, vec![(0, (1, 2, 2)), (1, (3, 3, 3)), (2, (0, 0, 1))]);
    assert_eq!(
        got,
        [
            ("a".to_string(), (0, 0, 1), vec![("0".to_string(), (0, 0, 1))]),
            ("b".to_string(), (3, 3, 3), vec![("0".to_string(), (1, 2, 2)), ("1".to_string(), (3, 3, 3))]),
        ]
    );
    // Few owners listed: only theirs are visited, the same rows.
    assert_eq!(rows(&mut s, vec![(3, (2, 2, 2))]), [("c".to_string(), (2, 2, 2), vec![("0".to_string(), (2, 2, 2))])]);
}

#[test]
fn the_json_answer() {
    let mut s = shape();
    assert_eq!(s.json(vec![], 0), b"{}");
    let json = String::from_utf8(s.json(vec![(2, (1, 1, 2))], 1)).unwrap();
    assert_eq!(json, r#"{"t":{"a":{"longest_matched":32,"GPU":16,"CPU":16,"DISK":32,"DP":{"0":32}}}}"#);
    // An instance without ranks goes.
    s.set_instance(utf32("a"), "a".to_string(), b"\"a\"".to_vec(), vec![], |r| r.to_string());
    assert_eq!(s.json(vec![(2, (1, 1, 2))], 1), b"{}");
}
