//! Fresh unique tokens: one per acquisition (the owner of a record) or record version.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::LockError;

/// Appends `bytes` to `out` in lowercase hex.
fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
}

/// The lowercase hex SHA-256 of `text`: how keys too long or too odd for an engine's
/// names are written, stable across builds and machines.
pub(crate) fn sha256_hex(text: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut out = String::with_capacity(64);
    push_hex(&mut out, &Sha256::digest(text.as_bytes()));
    out
}

/// A fresh 128-bit token, in hex, unique across processes and within one: this
/// process's random 64 bits (read once), then a count of the tokens it made.
/// [`LockError::Backend`] if the system has no randomness to give.
///
/// Only uniqueness is asked of a token (it names an owner; whoever can read the lock
/// server can delete its records anyway): two processes share one only if their 64
/// random bits are equal. A read of the system's randomness per token would be a
/// system call on every lock's path.
pub(crate) fn fresh_token() -> Result<String, LockError> {
    static PROCESS: OnceLock<Result<u64, String>> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let process = PROCESS.get_or_init(|| {
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).map_err(|error| error.to_string())?;
        Ok(u64::from_le_bytes(bytes))
    });
    let process = process
        .as_ref()
        .map_err(|error| LockError::Backend(Box::new(std::io::Error::other(error.clone()))))?;
    let count = COUNT.fetch_add(1, Ordering::Relaxed);
    let mut token = String::with_capacity(32);
    push_hex(&mut token, &process.to_be_bytes());
    push_hex(&mut token, &count.to_be_bytes());
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_is_the_standard_one() {
        // The FIPS 180-2 test vector: SHA-256, not a per-process hasher.
        assert_eq!(
            sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn tokens_are_128_bits_in_hex_and_never_repeat() {
        let (a, b) = (fresh_token().unwrap(), fresh_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_ne!(a, b);
        let tokens: std::collections::HashSet<_> =
            (0..10_000).map(|_| fresh_token().unwrap()).collect();
        assert_eq!(tokens.len(), 10_000);
    }
}
