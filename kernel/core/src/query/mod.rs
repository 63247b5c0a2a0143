//! A `POST /query` body read in one pass. See README.md.

mod token_query;

pub use token_query::{json_tokens, read_token_query, TokenQuery};
