//! A lock's DynamoDB item (see [The item](super#the-item)): where it lives, the names
//! of its attributes, the partition key value of a key, and the random tokens written
//! into it.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::ttl::sha256_hex;
use aws_sdk_dynamodb::types::AttributeValue;

/// The random token of the acquisition that holds the key; absent while free.
pub(super) const OWNER: &str = "lock_owner";
/// The record version number: random, rewritten at every grant and renewal. A waiter
/// that sees it unchanged for a whole lease may take the key over.
pub(super) const RVN: &str = "lock_rvn";
/// The lease the holder asked for, in milliseconds: how long a waiter watches.
pub(super) const LEASE_MS: &str = "lock_lease_ms";
/// The fence counter: the fencing token of the latest grant.
pub(super) const FENCE: &str = "lock_fence";

/// The longest partition key value DynamoDB accepts, in bytes.
const MAX_PARTITION_KEY: usize = 2048;

/// Where the lock items live: the table, its key attributes and its TTL attribute.
#[derive(Clone, Debug)]
pub(super) struct Layout {
    pub(super) table: String,
    pub(super) partition_key: String,
    /// The sort key attribute and the value every lock item has in it.
    pub(super) sort_key: Option<(String, String)>,
    pub(super) ttl_attribute: String,
}

impl Layout {
    /// The primary key of the item that locks `key` for the layer called `name`;
    /// `prefix` is normalized (non-empty, ends with `:`).
    pub(super) fn item_key(
        &self,
        prefix: &str,
        name: &str,
        key: &str,
    ) -> HashMap<String, AttributeValue> {
        let mut item_key = HashMap::with_capacity(2);
        item_key.insert(
            self.partition_key.clone(),
            AttributeValue::S(partition_value(prefix, name, key)),
        );
        if let Some((attribute, value)) = &self.sort_key {
            item_key.insert(attribute.clone(), AttributeValue::S(value.clone()));
        }
        item_key
    }
}

/// `<prefix><name>:<key>`, with any `:` or `%` in the layer name percent-escaped so
/// that the first `:` after the prefix ends the name. A key that starts with `#`, or
/// that would make the value longer than DynamoDB accepts, is written as `#` and the
/// hex SHA-256 of its UTF-8 bytes: a plain key never starts with `#`, so the two forms
/// never meet.
pub(super) fn partition_value(prefix: &str, name: &str, key: &str) -> String {
    let name = name.replace('%', "%25").replace(':', "%3A");
    let plain_len = prefix.len() + name.len() + 1 + key.len();
    if !key.starts_with('#') && plain_len <= MAX_PARTITION_KEY {
        return format!("{prefix}{name}:{key}");
    }
    format!("{prefix}{name}:#{}", sha256_hex(key))
}

/// Another owner's hold on a key, as read from its item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) rvn: String,
    pub(super) lease: Duration,
}

impl Holder {
    /// The holder in `item`, or `None` if the item is free. A record without (valid)
    /// version or lease, which this crate never writes, is watched for `default_lease`
    /// under an empty version that no takeover can match.
    pub(super) fn from_item(
        item: &HashMap<String, AttributeValue>,
        default_lease: Duration,
    ) -> Option<Self> {
        item.get(OWNER)?;
        let rvn = match item.get(RVN) {
            Some(AttributeValue::S(rvn)) => rvn.clone(),
            _ => String::new(),
        };
        let lease = match item.get(LEASE_MS) {
            Some(AttributeValue::N(ms)) => ms.parse().ok().map(Duration::from_millis),
            _ => None,
        };
        Some(Self {
            rvn,
            lease: lease.unwrap_or(default_lease),
        })
    }
}

/// The fencing token in an acquire's `UPDATED_NEW` attributes.
pub(super) fn fence(attributes: Option<&HashMap<String, AttributeValue>>) -> Option<u64> {
    match attributes?.get(FENCE)? {
        AttributeValue::N(fence) => fence.parse().ok(),
        _ => None,
    }
}

/// Wall-clock seconds since the epoch, `ahead` from now: a value for the TTL
/// attribute (DynamoDB deletes the item some time after it).
pub(super) fn epoch_seconds(ahead: Duration) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (now + ahead).as_secs().to_string()
}

/// Whole milliseconds, at least 1.
pub(super) fn millis(duration: Duration) -> String {
    duration.as_millis().max(1).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_keys_are_kept_after_the_prefix_and_name() {
        assert_eq!(
            partition_value("keyed-lock:", "orders", "42"),
            "keyed-lock:orders:42"
        );
        assert_eq!(partition_value("p:", "o", "a:b é"), "p:o:a:b é");
    }

    #[test]
    fn names_and_keys_cannot_reach_each_other() {
        let pairs = [
            ("a", "b:c"),
            ("a:b", "c"),
            ("a%3Ab", "c"),
            ("a", "#x"),
            ("a", &"k".repeat(3000)),
        ];
        let mut seen = std::collections::HashSet::new();
        for (name, key) in pairs {
            assert!(
                seen.insert(partition_value("p:", name, key)),
                "{name} {key}"
            );
        }
        assert_eq!(partition_value("p:", "a:b", "c"), "p:a%3Ab:c");
        assert_eq!(partition_value("p:", "a%3Ab", "c"), "p:a%253Ab:c");
    }

    #[test]
    fn hashed_keys_are_stable_and_fit_dynamodb() {
        assert_eq!(
            partition_value("p:", "n", "#abc"),
            format!("p:n:#{}", sha256_hex("#abc"))
        );
        // The FIPS 180-2 test vector: SHA-256, not a per-process hasher.
        assert_eq!(
            sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let long = "k".repeat(MAX_PARTITION_KEY);
        assert!(partition_value("p:", "n", &long).len() <= MAX_PARTITION_KEY);
        let fits = "k".repeat(MAX_PARTITION_KEY - "p:n:".len());
        assert_eq!(partition_value("p:", "n", &fits), format!("p:n:{fits}"));
    }

    #[test]
    fn a_holder_is_read_from_its_item() {
        let lease = Duration::from_secs(30);
        let mut item = HashMap::new();
        assert_eq!(Holder::from_item(&item, lease), None);
        item.insert(OWNER.to_owned(), AttributeValue::S("o".into()));
        assert_eq!(
            Holder::from_item(&item, lease),
            Some(Holder {
                rvn: String::new(),
                lease
            })
        );
        item.insert(RVN.to_owned(), AttributeValue::S("r".into()));
        item.insert(LEASE_MS.to_owned(), AttributeValue::N("1500".into()));
        assert_eq!(
            Holder::from_item(&item, lease),
            Some(Holder {
                rvn: "r".into(),
                lease: Duration::from_millis(1500)
            })
        );
    }
}
