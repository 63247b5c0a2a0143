//! `kvconductor.wire.query.read_token_query`, compiled: a `POST /query`
//! body read in one pass, its tokens packed as they are parsed. Only what
//! is plainly valid is taken; anything else (a wrong type, a duplicate or
//! missing field, a token outside u32, not an object, an escaped key) gives
//! None and the API's msgspec decoder answers it, with its exact errors.
//!
//! serde_json reads every key and every value but the prompt, one at a
//! time; the prompt's array is read by `token_array`. Through serde's
//! visitor a token cost 18 ns, and serde cannot hand an array on unscanned:
//! for an 8,192-token prompt that was 150 of the HTTP server's ~600 us.

use serde::de::IgnoredAny;
use serde::Deserialize;

/// `kvconductor.wire.query.TokenQuery`'s fields as they are read.
#[derive(Default)]
struct Fields {
    model: Option<String>,
    block_size: Option<serde_json::Number>,
    token_ids: Option<Vec<u8>>,
    lora_name: Option<Option<String>>,
    tenant_id: Option<Option<String>>,
    instance_id: Option<Option<String>>,
    cache_salt: Option<Option<String>>,
}

/// A query whose fields are all plainly valid; `token_ids` packed as
/// little-endian u32.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenQuery {
    pub model: String,
    pub block_size: i128,
    pub token_ids: Vec<u8>,
    pub lora_name: Option<String>,
    pub tenant_id: Option<String>,
    pub instance_id: Option<String>,
    pub cache_salt: Option<String>,
}

/// The body's query, or None for anything not plainly valid (see the
/// module doc).
pub fn read_token_query(body: &[u8]) -> Option<TokenQuery> {
    let f = fields(body)?;
    let block_size = f.block_size?;
    let block_size = match (block_size.as_i64(), block_size.as_u64()) {
        (Some(n), _) => i128::from(n),
        (None, Some(n)) => i128::from(n),
        _ => return None, // a float: the typed decoder says no
    };
    Some(TokenQuery {
        model: f.model?,
        block_size,
        token_ids: f.token_ids?,
        lora_name: f.lora_name.flatten(),
        tenant_id: f.tenant_id.flatten(),
        instance_id: f.instance_id.flatten(),
        cache_salt: f.cache_salt.flatten(),
    })
}

/// The fields of one JSON object, each at most once; unknown keys are
/// skipped, as msgspec does.
fn fields(body: &[u8]) -> Option<Fields> {
    let mut f = Fields::default();
    let mut at = skip_space(body, 0);
    if body.get(at) != Some(&b'{') {
        return None;
    }
    at = skip_space(body, at + 1);
    if body.get(at) == Some(&b'}') {
        return Some(f);
    }
    loop {
        let key: &str = value_at(body, &mut at)?;
        at = skip_space(body, at);
        if body.get(at) != Some(&b':') {
            return None;
        }
        at = skip_space(body, at + 1);
        match key {
            "token_ids" => once(&mut f.token_ids, token_array(body, &mut at)?)?,
            "model" => once(&mut f.model, value_at(body, &mut at)?)?,
            "block_size" => once(&mut f.block_size, value_at(body, &mut at)?)?,
            "lora_name" => once(&mut f.lora_name, value_at(body, &mut at)?)?,
            "tenant_id" => once(&mut f.tenant_id, value_at(body, &mut at)?)?,
            "instance_id" => once(&mut f.instance_id, value_at(body, &mut at)?)?,
            "cache_salt" => once(&mut f.cache_salt, value_at(body, &mut at)?)?,
            _ => {
                let _: IgnoredAny = value_at(body, &mut at)?;
            }
        }
        at = skip_space(body, at);
        match body.get(at) {
            Some(b',') => at = skip_space(body, at + 1),
            Some(b'}') => break,
            _ => return None,
        }
    }
    (skip_space(body, at + 1) == body.len()).then_some(f)
}

/// A duplicate field is the typed decoder's to judge.
fn once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    slot.is_none().then(|| *slot = Some(value))
}

/// The JSON value at `*at`, read by serde; `*at` moves past it.
fn value_at<'de, T: Deserialize<'de>>(json: &'de [u8], at: &mut usize) -> Option<T> {
    let mut values = serde_json::Deserializer::from_slice(json.get(*at..)?).into_iter::<T>();
    let value = values.next()?.ok()?;
    *at += values.byte_offset();
    Some(value)
}

/// `kvconductor.wire.hashing.tokens_from_json`: one JSON array of token ids in
/// [0, 2**32), as little-endian u32 bytes; None for anything else.
pub fn json_tokens(json: &[u8]) -> Option<Vec<u8>> {
    let mut at = skip_space(json, 0);
    let packed = token_array(json, &mut at)?;
    (skip_space(json, at) == json.len()).then_some(packed)
}

/// The JSON array at `*at` as little-endian u32 bytes when every element
/// is an integer in [0, 2**32) written plainly (no sign, fraction or
/// exponent); `*at` moves past it. None for anything else, malformed JSON
/// included.
fn token_array(json: &[u8], at: &mut usize) -> Option<Vec<u8>> {
    if json.get(*at) != Some(&b'[') {
        return None;
    }
    // A token takes at least two bytes with its separator and packs into
    // four, so this is outgrown only by prompts of one- and two-digit ids.
    let mut out = Vec::with_capacity(json.len() - *at);
    let mut i = skip_space(json, *at + 1);
    if json.get(i) == Some(&b']') {
        *at = i + 1;
        return Some(out);
    }
    loop {
        let (token, digits) = match json.get(i..i + 8) {
            Some(eight) => eight_digits(eight).or_else(|| digits_at(json, i))?,
            None => digits_at(json, i)?,
        };
        out.extend_from_slice(&u32::try_from(token).ok()?.to_le_bytes());
        i = skip_space(json, i + digits);
        match json.get(i) {
            Some(b',') => i = skip_space(json, i + 1),
            Some(b']') => break,
            _ => return None,
        }
    }
    *at = i + 1;
    Some(out)
}

/// The number of 1 to 7 digits that `eight` starts with, and its length,
/// read without a branch per digit (a mispredicted branch per token was
/// most of a plain loop's time); None for anything else.
fn eight_digits(eight: &[u8]) -> Option<(u64, usize)> {
    let word = u64::from_le_bytes(eight.try_into().ok()?);
    // Each byte less '0'; a borrow only reaches bytes after a non-digit.
    let values = word.wrapping_sub(0x3030_3030_3030_3030);
    // A byte's top bit is set here unless it was a digit.
    let non_digits = (values.wrapping_add(0x7676_7676_7676_7676) | values) & 0x8080_8080_8080_8080;
    let len = (non_digits.trailing_zeros() / 8) as usize;
    if len == 0 || len == 8 || (len > 1 && values & 0xFF == 0) {
        return None; // not a number, too long for this word, or a leading zero
    }
    // The digits moved to the word's top; the bytes below them read as zeros.
    let v = values << (8 * (8 - len));
    let v = (v & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561) >> 8;
    let v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
    let v = (v & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32;
    Some((v, len))
}

/// `eight_digits` one digit at a time: near the end of the body and for
/// eight digits or more. At most ten digits, without a leading zero.
fn digits_at(json: &[u8], start: usize) -> Option<(u64, usize)> {
    let mut value = 0u64;
    let mut at = start;
    while let Some(digit) = json.get(at).map(|b| b.wrapping_sub(b'0')).filter(|d| *d < 10) {
        if at - start == 10 || (at > start && value == 0) {
            return None;
        }
        value = value * 10 + u64::from(digit);
        at += 1;
    }
    (at > start).then_some((value, at - start))
}

fn skip_space(json: &[u8], mut at: usize) -> usize {
    while matches!(json.get(at), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        at += 1;
    }
    at
}
