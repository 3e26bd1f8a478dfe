//! The name of a lock's object (see [object names](super#object-names)).

use crate::backend::key_component::{name_and_key, push_url_safe};

/// The longest prefix accepted: with the longest name and key parts (two hashes or
/// 128 escaped bytes each) an object name stays far below S3's 1024 bytes.
pub(super) const MAX_PREFIX_LEN: usize = 512;

/// The part that names the objects of [`build`](super::S3BackendBuilder::build)'s
/// probe instead of a layer name: no escaped name is ever written so (an escaped part
/// that starts with `#` is followed by 64 hex digits).
const PROBE_PART: &str = "#probe";

/// `<prefix><name>/<key>`, each part escaped (or hashed) as etcd keys and blob names
/// are: no `/` inside a part, and distinct parts stay distinct.
pub(super) fn object_name(prefix: &str, name: &str, key: &str) -> String {
    name_and_key(prefix, name, key, push_url_safe)
}

/// The object the setup probe writes, under the prefix but outside every layer's
/// objects: `<prefix>#probe/<token>`.
pub(super) fn probe_name(prefix: &str, token: &str) -> String {
    format!("{prefix}{PROBE_PART}/{token}")
}

/// A prefix as object names start with it: not empty (it keeps lock objects apart
/// from the bucket's others), ending with `/`, and short enough to leave room for the
/// layer's name and the key.
pub(super) fn object_prefix(prefix: &str) -> Result<String, String> {
    if prefix.is_empty() {
        return Err("is empty: a prefix keeps lock objects apart from the bucket's others".into());
    }
    let prefix = crate::backend::key_component::with_slash(prefix);
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(format!(
            "is {} bytes, more than {MAX_PREFIX_LEN}",
            prefix.len()
        ));
    }
    Ok(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::key_component::{distinct_paths, MAX_PLAIN_LEN};
    use crate::backend::ttl::sha256_hex;

    #[test]
    fn plain_names_and_keys_are_kept_and_others_escaped() {
        assert_eq!(
            object_name("keyed-lock/", "orders", "order-42"),
            "keyed-lock/orders/order-42"
        );
        assert_eq!(
            object_name("p/", "a/b", "../x y/é%#"),
            "p/a%2Fb/..%2Fx%20y%2F%C3%A9%25%23"
        );
    }

    #[test]
    fn long_and_empty_parts_are_hashed_and_names_stay_short() {
        let long = "k".repeat(MAX_PLAIN_LEN + 1);
        assert_eq!(
            object_name("p/", "n", &long),
            format!("p/n/#{}", sha256_hex(&long))
        );
        assert_eq!(
            object_name("p/", "", "k"),
            format!("p/#{}/k", sha256_hex(""))
        );
        let widest = "/".repeat(MAX_PLAIN_LEN / 3);
        let longest = object_name(&"p".repeat(MAX_PREFIX_LEN), &widest, &widest);
        assert!(longest.len() < 1024, "{}", longest.len());
    }

    #[test]
    fn distinct_pairs_get_distinct_objects_and_never_the_probe_s() {
        let names = distinct_paths(&[("#probe", "t")], |name, key| object_name("p/", name, key));
        assert!(!names.contains(&probe_name("p/", "t")));
    }

    #[test]
    fn the_prefix_gets_a_slash_and_must_fit() {
        assert_eq!(object_prefix("locks").unwrap(), "locks/");
        assert_eq!(object_prefix("locks/").unwrap(), "locks/");
        assert!(object_prefix("").is_err());
        assert!(object_prefix(&"p".repeat(MAX_PREFIX_LEN + 1)).is_err());
    }
}
