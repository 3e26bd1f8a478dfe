//! Request keys and layer names as parts of an engine's names (etcd keys, blob
//! names): percent-escaped, or hashed when empty or too long, so no part ever holds a
//! separator and distinct parts never share a name.

use std::fmt::Write as _;

use crate::backend::ttl::sha256_hex;

/// A name or key longer than this once escaped is hashed.
pub(crate) const MAX_PLAIN_LEN: usize = 128;

/// Bytes written as they are; every other byte is `%XX`.
fn plain(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-_.~:@+=,".contains(&byte)
}

/// Appends a layer name or request key as it appears in an engine's name:
/// percent-escaped (so it has no `/`), or `#` + hex SHA-256 when empty or longer than
/// [`MAX_PLAIN_LEN`] escaped. An escaped form never starts with `#` (`#` is escaped),
/// so the forms never collide.
pub(crate) fn push_component(out: &mut String, text: &str) {
    let escaped_len: usize = text
        .bytes()
        .map(|byte| if plain(byte) { 1 } else { 3 })
        .sum();
    if text.is_empty() || escaped_len > MAX_PLAIN_LEN {
        out.push('#');
        out.push_str(&sha256_hex(text));
        return;
    }
    for byte in text.bytes() {
        if plain(byte) {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
}

/// `prefix` as the start of every name: a trailing `/` added if missing.
pub(crate) fn with_slash(prefix: &str) -> String {
    let mut prefix = prefix.to_owned();
    if !prefix.ends_with('/') {
        prefix.push('/');
    }
    prefix
}
