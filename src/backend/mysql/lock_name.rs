//! The stable lock name of a key: `<prefix>:<layer name>:<key>`, or a SHA-256 digest
//! of it when that is longer than MySQL's limit of 64 characters.

use sha2::{Digest, Sha256};

/// The longest lock name MySQL accepts (MySQL 5.7 and later refuse longer ones;
/// MariaDB takes them, but the backend keeps one rule for both).
pub const MAX_LOCK_NAME_LEN: usize = 64;

/// The longest [`prefix`](super::MySqlBackendBuilder::prefix): a hashed name keeps at
/// least 39 hex digits (156 bits) of the digest after it.
pub(super) const MAX_PREFIX_LEN: usize = 24;

/// The `GET_LOCK` name of `key` under the layer `name` in `prefix`, the same on every
/// build and machine.
///
/// `<prefix>:<name>:<key>` when that is at most [`MAX_LOCK_NAME_LEN`] bytes;
/// otherwise `<prefix>#` followed by the first hex digits of SHA-256 over the
/// prefix, the layer name and the key (each as its UTF-8 bytes prefixed by their
/// length as a big-endian `u32`, as the PostgreSQL backend hashes them), up to 64
/// characters in all. A plain name has a `:` right after the prefix, a hashed one a
/// `#`, so the two never meet. The backend sends the name as a hex literal (its UTF-8
/// bytes), so any key is safe in SQL.
///
/// ```
/// use tower_keyed_lock::backend::mysql::lock_name;
///
/// assert_eq!(lock_name("tkl", "orders", "42"), "tkl:orders:42");
/// let long = lock_name("tkl", "orders", &"x".repeat(100));
/// assert_eq!(long.len(), 64);
/// assert!(long.starts_with("tkl#"));
/// assert_eq!(long, lock_name("tkl", "orders", &"x".repeat(100))); // stable
/// ```
pub fn lock_name(prefix: &str, name: &str, key: &str) -> String {
    let plain = format!("{prefix}:{name}:{key}");
    if plain.len() <= MAX_LOCK_NAME_LEN {
        return plain;
    }
    let mut hasher = Sha256::new();
    for part in [prefix, name, key] {
        hasher.update((part.len() as u32).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    let mut hashed = String::with_capacity(MAX_LOCK_NAME_LEN);
    hashed.push_str(prefix);
    hashed.push('#');
    for byte in digest {
        for nibble in [byte >> 4, byte & 0xf] {
            if hashed.len() < MAX_LOCK_NAME_LEN {
                hashed.push(char::from_digit(u32::from(nibble), 16).expect("a nibble"));
            }
        }
    }
    hashed
}

/// `text` as a MySQL hex literal (`X'…'`): its bytes, with nothing to escape.
pub(super) fn hex_literal(text: &str) -> String {
    let mut literal = String::with_capacity(3 + 2 * text.len());
    literal.push_str("X'");
    for byte in text.bytes() {
        for nibble in [byte >> 4, byte & 0xf] {
            literal.push(char::from_digit(u32::from(nibble), 16).expect("a nibble"));
        }
    }
    literal.push('\'');
    literal
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_are_plain_and_long_ones_hashed() {
        assert_eq!(lock_name("ns", "jobs", "a"), "ns:jobs:a");
        let exactly = "k".repeat(MAX_LOCK_NAME_LEN - "ns:jobs:".len());
        assert_eq!(lock_name("ns", "jobs", &exactly).len(), MAX_LOCK_NAME_LEN);
        assert!(!lock_name("ns", "jobs", &exactly).contains('#'));
        let longer = format!("{exactly}k");
        let hashed = lock_name("ns", "jobs", &longer);
        assert_eq!(hashed.len(), MAX_LOCK_NAME_LEN);
        assert!(hashed.starts_with("ns#"));
        assert_ne!(hashed, lock_name("ns", "jobs", &format!("{exactly}j")));
        // Multi-byte keys count in bytes.
        assert_eq!(
            lock_name("ns", "jobs", &"é".repeat(40)).len(),
            MAX_LOCK_NAME_LEN
        );
    }

    #[test]
    fn the_digest_is_fixed() {
        // Pinned (and checked with Python's hashlib): a change here would split
        // instances of two builds.
        assert_eq!(
            lock_name("tower-keyed-lock", "orders", &"7".repeat(60)),
            "tower-keyed-lock#6fd54093b39414c02860bacd491094d1f2c33f90c3cf5c6"
        );
    }

    #[test]
    fn hex_literals() {
        assert_eq!(hex_literal("Ab'"), "X'416227'");
    }
}
