//! A layer name or request key as one component of an engine's path (etcd keys,
//! ZooKeeper nodes, blob names): percent-escaped, or hashed when empty or too long, so
//! that any UTF-8 text is safe there and distinct texts never share a component.

use std::fmt::Write as _;

use crate::backend::ttl::sha256_hex;

/// Appends `text` to `out`: every byte for which `plain` is false written `%XX` (so a
/// separator never appears raw, provided `plain` refuses it and `%` and `#`), or `#`
/// and the lowercase hex SHA-256 of the UTF-8 bytes when `text` is empty or its
/// escaped form is longer than `max_plain_len` (stable across builds and machines). An
/// escaped form never starts with `#`, so the two forms never collide.
pub(crate) fn push_component(
    out: &mut String,
    text: &str,
    plain: fn(u8) -> bool,
    max_plain_len: usize,
) {
    let escaped_len: usize = text
        .bytes()
        .map(|byte| if plain(byte) { 1 } else { 3 })
        .sum();
    if text.is_empty() || escaped_len > max_plain_len {
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

/// A name or key longer than this once escaped is hashed (etcd keys, blob names).
#[cfg(any(feature = "etcd", feature = "azure-blob", feature = "s3"))]
pub(crate) const MAX_PLAIN_LEN: usize = 128;

/// The bytes etcd keys and blob names keep as they are: every other byte is `%XX`.
#[cfg(any(feature = "etcd", feature = "azure-blob", feature = "s3"))]
fn url_safe(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-_.~:@+=,".contains(&byte)
}

/// [`push_component`] with the bytes of [`url_safe`] plain and [`MAX_PLAIN_LEN`]: no
/// `/`, `%` or `#` ever appears raw.
#[cfg(any(feature = "etcd", feature = "azure-blob", feature = "s3"))]
pub(crate) fn push_url_safe(out: &mut String, text: &str) {
    push_component(out, text, url_safe, MAX_PLAIN_LEN);
}

/// `<prefix><name>/<key>`, the layer's name and the key each written by `push_part`
/// (which keeps `/` out of a part): the path of a lock's etcd keys, blob or object.
#[cfg(any(feature = "etcd", feature = "azure-blob", feature = "s3"))]
pub(crate) fn name_and_key(
    prefix: &str,
    name: &str,
    key: &str,
    push_part: fn(&mut String, &str),
) -> String {
    let mut path = String::with_capacity(prefix.len() + name.len() + key.len() + 8);
    path.push_str(prefix);
    push_part(&mut path, name);
    path.push('/');
    push_part(&mut path, key);
    path
}

/// `prefix` as the start of every name: a trailing `/` added if missing.
#[cfg(any(feature = "etcd", feature = "azure-blob", feature = "s3"))]
pub(crate) fn with_slash(prefix: &str) -> String {
    let mut prefix = prefix.to_owned();
    if !prefix.ends_with('/') {
        prefix.push('/');
    }
    prefix
}

/// (name, key) pairs a slip in the escaping would give one path: a separator inside a
/// part and its escaped form, the hash marker, dots and their escaped form, empty text.
#[cfg(test)]
const CONFUSABLE: [(&str, &str); 13] = [
    ("a", "b/c"),
    ("a/b", "c"),
    ("a", "b"),
    ("a", "bc"),
    ("a", "b%2Fc"),
    ("a", "#"),
    ("a", ""),
    ("", "a"),
    ("a", "."),
    ("a", "%2E"),
    ("a", "b."),
    ("a", "b%2E"),
    ("a.", "b"),
];

/// The paths `path` gives the [`CONFUSABLE`] pairs, a key long enough to be hashed and
/// `extra`, asserting that no two pairs share one.
#[cfg(test)]
pub(crate) fn distinct_paths(
    extra: &[(&str, &str)],
    path: impl Fn(&str, &str) -> String,
) -> Vec<String> {
    let long = "x".repeat(200);
    let long = [("a", long.as_str())];
    let mut seen = std::collections::HashMap::new();
    let pairs = CONFUSABLE.iter().chain(&long).chain(extra);
    pairs
        .map(|&pair| {
            let path = path(pair.0, pair.1);
            if let Some(other) = seen.insert(path.clone(), pair) {
                panic!("{other:?} and {pair:?} both get {path}");
            }
            path
        })
        .collect()
}
