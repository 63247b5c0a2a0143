//! u64-keyed maps and sets for the store: one linear-probing table
//! (`table`) under three meanings. See README.md.

pub mod count_map;
pub mod seq_set;
pub mod sharded;
pub mod table;

pub use count_map::CountMap;
pub use seq_set::SeqSet;
pub use sharded::{ShardedMap, Vacant};
