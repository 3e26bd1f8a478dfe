//! The stable lock id of a key (see [Lock ids](super#lock-ids)), and its SQL form.

use sha2::{Digest, Sha256};

/// The SQL that computes a lock id, as [`lock_id`] does: `$1` the prefix, `$2` the
/// layer name, `$3` the key (all `text`); returns a `bigint`.
///
/// ```no_run
/// # async fn f(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
/// use tower_keyed_lock::backend::postgres::{lock_id, LOCK_ID_SQL};
///
/// let row = client.query_one(LOCK_ID_SQL, &[&"tower-keyed-lock", &"orders", &"42"]).await?;
/// assert_eq!(row.get::<_, i64>(0), lock_id("tower-keyed-lock", "orders", "42"));
/// # Ok(())
/// # }
/// ```
pub const LOCK_ID_SQL: &str = "SELECT ('x' || substr(encode(sha256(\
    int4send(octet_length(convert_to($1, 'UTF8'))) || convert_to($1, 'UTF8') || \
    int4send(octet_length(convert_to($2, 'UTF8'))) || convert_to($2, 'UTF8') || \
    int4send(octet_length(convert_to($3, 'UTF8'))) || convert_to($3, 'UTF8')\
    ), 'hex'), 1, 16))::bit(64)::bigint";

/// The advisory lock id of `key` under the layer `name` and `prefix`: the first 8
/// bytes, big-endian, of SHA-256 over the three strings, each prefixed by its length in
/// bytes as a big-endian `u32`. Stable across builds and machines; see the
/// [module docs](super#lock-ids) for SQL and Python versions.
///
/// ```
/// use tower_keyed_lock::backend::postgres::lock_id;
///
/// assert_eq!(lock_id("tower-keyed-lock", "orders", "42"), -2_357_060_318_159_420_717);
/// ```
pub fn lock_id(prefix: &str, name: &str, key: &str) -> i64 {
    let mut hasher = Sha256::new();
    for part in [prefix, name, key] {
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ. Keys are at most
        // `max_key_len` bytes, far below u32::MAX.
        let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        hasher.update(len.to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_ids_are_length_prefixed() {
        assert_ne!(lock_id("ns", "ab", "c"), lock_id("ns", "a", "bc"));
        assert_ne!(lock_id("ns", "a", "b"), lock_id("ns", "b", "a"));
    }

    #[test]
    fn lock_id_is_sha256_prefix() {
        // sha256(00000002 "ns" 00000001 "n" 00000001 "k"), computed independently.
        let mut message = Vec::new();
        for part in ["ns", "n", "k"] {
            message.extend_from_slice(&(part.len() as u32).to_be_bytes());
            message.extend_from_slice(part.as_bytes());
        }
        let digest = Sha256::digest(&message);
        let expected = i64::from_be_bytes(digest[..8].try_into().unwrap());
        assert_eq!(lock_id("ns", "n", "k"), expected);
    }
}
