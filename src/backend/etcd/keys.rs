//! The names of a lock's etcd keys (see [etcd keys](super#etcd-keys)).

use std::fmt::Write as _;

pub(super) use crate::backend::key_component::with_slash;
use crate::backend::key_component::{name_and_key, push_url_safe};

/// The etcd keys of one lock: the queue's prefix, under which every contender's key
/// lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct LockKeys {
    /// `<prefix><name>/<key>/`: every contender's key starts with it, and no other
    /// lock's does.
    pub(super) queue: String,
}

impl LockKeys {
    /// `prefix` is normalized (non-empty, ending with `/`).
    pub(super) fn new(prefix: &str, name: &str, key: &str) -> Self {
        let mut queue = name_and_key(prefix, name, key, push_url_safe);
        queue.push('/');
        Self { queue }
    }

    /// The key of the contender whose etcd lease is `lease`: the queue's prefix and
    /// the lease id in 16 hex digits.
    pub(super) fn contender(&self, lease: i64) -> String {
        let mut key = self.queue.clone();
        let _ = write!(key, "{lease:016x}");
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::key_component::{distinct_paths, MAX_PLAIN_LEN};
    use crate::backend::ttl::sha256_hex;

    #[test]
    fn plain_names_and_keys_are_kept() {
        let keys = LockKeys::new("keyed-lock/", "orders", "order-42");
        assert_eq!(keys.queue, "keyed-lock/orders/order-42/");
        assert_eq!(
            keys.contender(0x1234),
            "keyed-lock/orders/order-42/0000000000001234"
        );
    }

    #[test]
    fn separators_and_other_bytes_are_escaped() {
        let keys = LockKeys::new("p/", "a/b", "../x y/é%#");
        assert_eq!(keys.queue, "p/a%2Fb/..%2Fx%20y%2F%C3%A9%25%23/");
        // Exactly three slashes: prefix, name, key.
        assert_eq!(keys.queue.matches('/').count(), 3);
    }

    #[test]
    fn long_and_empty_text_is_hashed_stably() {
        let long = "k".repeat(MAX_PLAIN_LEN + 1);
        let keys = LockKeys::new("p/", "n", &long);
        assert_eq!(keys.queue, format!("p/n/#{}/", sha256_hex(&long)));
        let keys = LockKeys::new("p/", "", "k");
        assert_eq!(keys.queue, format!("p/#{}/k/", sha256_hex("")));
        // 128 bytes escaped is still plain; 43 escaped bytes (129) are not.
        let edge = "k".repeat(MAX_PLAIN_LEN);
        assert_eq!(
            LockKeys::new("p/", "n", &edge).queue,
            format!("p/n/{edge}/")
        );
        let escaped = "/".repeat(43);
        assert!(LockKeys::new("p/", "n", &escaped).queue.contains('#'));
        // The FIPS 180-2 test vector: SHA-256, not a per-process hasher.
        assert_eq!(
            sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn no_lock_queue_is_a_prefix_of_another() {
        // Under one prefix: names and keys never hold a `/`.
        let queues = distinct_paths(&[], |name, key| LockKeys::new("p/", name, key).queue);
        for (i, a) in queues.iter().enumerate() {
            for (j, b) in queues.iter().enumerate() {
                if i != j {
                    assert!(!b.starts_with(a.as_str()), "{a} is a prefix of {b}");
                }
            }
        }
    }

    #[test]
    fn the_prefix_gets_a_slash() {
        assert_eq!(with_slash("app"), "app/");
        assert_eq!(with_slash("app/"), "app/");
    }
}
