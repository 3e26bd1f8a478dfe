//! The name of a lock's blob (see [blob names](super#blob-names)).

pub(super) use crate::backend::key_component::with_slash;
use crate::backend::key_component::{name_and_key, push_url_safe as push_component};

/// The longest prefix accepted: with the longest name and key parts (two hashes) the
/// blob name stays far below Azure's 1024 characters.
pub(super) const MAX_PREFIX_LEN: usize = 512;

/// `<prefix><name>/<key>`, each part escaped (or hashed) as etcd keys are, and a part
/// ending with `.` written with `%2E` instead: Azure advises against blob names (and
/// path segments) that end with a dot, and `.`/`..` are no path segments at all then.
pub(super) fn blob_name(prefix: &str, name: &str, key: &str) -> String {
    name_and_key(prefix, name, key, push_part)
}

/// One escaped part. `.` is plain in the escaped form, so `%2E` never appears in it
/// otherwise (a literal `%` is `%25`): the rewrite keeps distinct parts distinct.
fn push_part(out: &mut String, text: &str) {
    let start = out.len();
    push_component(out, text);
    if out.len() > start && out.ends_with('.') {
        out.pop();
        out.push_str("%2E");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::key_component::{distinct_paths, MAX_PLAIN_LEN};
    use crate::backend::ttl::sha256_hex;

    #[test]
    fn plain_names_and_keys_are_kept() {
        assert_eq!(
            blob_name("keyed-lock/", "orders", "order-42"),
            "keyed-lock/orders/order-42"
        );
    }

    #[test]
    fn separators_dots_and_other_bytes_are_escaped() {
        assert_eq!(
            blob_name("p/", "a/b", "../x y/é%#"),
            "p/a%2Fb/..%2Fx%20y%2F%C3%A9%25%23"
        );
        assert_eq!(blob_name("p/", ".", ".."), "p/%2E/.%2E");
        assert_eq!(blob_name("p/", "n", "v1.2."), "p/n/v1.2%2E");
        // A key that spells the rewrite is escaped differently.
        assert_eq!(blob_name("p/", "n", "v1.2%2E"), "p/n/v1.2%252E");
    }

    #[test]
    fn long_and_empty_parts_are_hashed() {
        let long = "k".repeat(MAX_PLAIN_LEN + 1);
        assert_eq!(
            blob_name("p/", "n", &long),
            format!("p/n/#{}", sha256_hex(&long))
        );
        assert_eq!(blob_name("p/", "", "k"), format!("p/#{}/k", sha256_hex("")));
        // The longest parts: 128 bytes escaped whose last is a dot (130 written).
        let dotted = format!("{}.", "k".repeat(MAX_PLAIN_LEN - 1));
        assert_eq!(blob_name("", &dotted, &dotted).len(), 261);
        let longest = blob_name(&"p".repeat(MAX_PREFIX_LEN), &dotted, &dotted);
        assert!(longest.len() < 1024, "{}", longest.len());
    }

    #[test]
    fn distinct_pairs_get_distinct_blobs() {
        distinct_paths(&[], |name, key| blob_name("p/", name, key));
    }
}
