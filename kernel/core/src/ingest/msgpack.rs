//! Token ids in msgpack, read a token at a time.

/// One msgpack integer in [0, 2**32). The encodings an encoder picks for
/// such a value (the smallest) are read here; any other goes through
/// `rmp`, which takes every integer encoding and checks the range (a
/// generic read per token was half of this function's time).
#[inline]
pub fn msgpack_u32(rd: &mut &[u8]) -> Option<u32> {
    let (&marker, rest) = rd.split_first()?;
    let (value, len) = match marker {
        0x00..=0x7f => (u32::from(marker), 0),
        0xcc => (u32::from(*rest.first()?), 1),
        0xcd => (u32::from(u16::from_be_bytes(rest.get(..2)?.try_into().ok()?)), 2),
        0xce => (u32::from_be_bytes(rest.get(..4)?.try_into().ok()?), 4),
        _ => return rmp::decode::read_int(rd).ok(),
    };
    *rd = &rest[len..];
    Some(value)
}
