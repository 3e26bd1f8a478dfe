//! The paths of a lock's ZooKeeper nodes (see [ZooKeeper nodes](super#zookeeper-nodes)).

use crate::backend::key_component;

/// A name or key longer than this once escaped is hashed.
pub(super) const MAX_PLAIN_LEN: usize = 128;

/// What every contender node's name starts with: ZooKeeper's "protected" recipe (as
/// Curator writes it), so that a node whose create was never answered is found by its
/// token.
const PROTECTED: &str = "_c_";
/// Between the token and the sequence number ZooKeeper appends.
const LOCK_TAG: &str = "-lock-";
/// A token is 128 random bits in lowercase hex.
const TOKEN_LEN: usize = 32;

/// The nodes of one lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct LockPath {
    /// `<prefix>/<name>/<key>`: the queue, whose children are the contenders.
    pub(super) queue: String,
}

impl LockPath {
    /// `prefix` is normalized (starts with `/`, no trailing `/`; see [`normalize_prefix`]).
    pub(super) fn new(prefix: &str, name: &str, key: &str) -> Self {
        let mut queue = String::with_capacity(prefix.len() + name.len() + key.len() + 2);
        queue.push_str(prefix);
        queue.push('/');
        push_component(&mut queue, name);
        queue.push('/');
        push_component(&mut queue, key);
        Self { queue }
    }

    /// The path a contender with `token` asks to create; ZooKeeper appends the
    /// sequence number.
    pub(super) fn contender_prefix(&self, token: &str) -> String {
        format!("{}/{PROTECTED}{token}{LOCK_TAG}", self.queue)
    }

    /// The full path of the child `name` of the queue.
    pub(super) fn child(&self, name: &str) -> String {
        format!("{}/{name}", self.queue)
    }
}

/// One contender node, as read from the queue's children.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Contender<'a> {
    pub(super) name: &'a str,
    pub(super) token: &'a str,
    pub(super) sequence: i64,
}

/// Parses a child of a queue: `_c_<token>-lock-<sequence>`; anything else (a node
/// written by hand) is not a contender.
pub(super) fn parse_contender(name: &str) -> Option<Contender<'_>> {
    let rest = name.strip_prefix(PROTECTED)?;
    let token = rest.get(..TOKEN_LEN)?;
    let sequence = rest.get(TOKEN_LEN..)?.strip_prefix(LOCK_TAG)?;
    if !token.bytes().all(|b| b.is_ascii_hexdigit())
        || !sequence.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    Some(Contender {
        name,
        token,
        sequence: sequence.parse().ok()?,
    })
}

/// Bytes written as they are; every other byte is `%XX`. Unlike etcd's, `.` is
/// escaped too, so the names `.` and `..` (which ZooKeeper refuses) never appear.
fn plain(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"-_~:@+=,".contains(&byte)
}

/// Appends a layer name or request key as one node name: percent-escaped (no `/`, no
/// `.`), or `#` + hex SHA-256 when empty or longer than [`MAX_PLAIN_LEN`] escaped;
/// `zookeeper`, reserved at the root, is written with its first letter escaped.
fn push_component(out: &mut String, text: &str) {
    if text == "zookeeper" {
        out.push_str("%7Aookeeper");
        return;
    }
    key_component::push_component(out, text, plain, MAX_PLAIN_LEN);
}

/// Why a prefix is not a usable ZooKeeper path.
pub(super) fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.is_empty() {
        return Err("the prefix is empty (the lock nodes would sit at the root)".to_owned());
    }
    for component in prefix[1..].split('/') {
        if component.is_empty() || component == "." || component == ".." {
            return Err(format!(
                "the prefix {prefix:?} is not a valid ZooKeeper path"
            ));
        }
        if component.chars().any(|c| c.is_control()) {
            return Err(format!("the prefix {prefix:?} holds a control character"));
        }
    }
    if prefix == "/zookeeper" || prefix.starts_with("/zookeeper/") {
        return Err(format!(
            "the prefix {prefix:?} is under ZooKeeper's reserved /zookeeper"
        ));
    }
    Ok(())
}

/// `prefix` as the start of every path: a leading `/` added, trailing ones removed.
pub(super) fn normalize_prefix(prefix: &str) -> String {
    let trimmed = prefix.trim_end_matches('/');
    if trimmed.starts_with('/') {
        trimmed.to_owned()
    } else if trimmed.is_empty() {
        String::new()
    } else {
        format!("/{trimmed}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::key_component::distinct_paths;
    use crate::backend::ttl::sha256_hex;

    #[test]
    fn plain_names_and_keys_are_kept() {
        let path = LockPath::new("/keyed-lock", "orders", "order-42");
        assert_eq!(path.queue, "/keyed-lock/orders/order-42");
        let token = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            path.contender_prefix(token),
            format!("/keyed-lock/orders/order-42/_c_{token}-lock-")
        );
    }

    #[test]
    fn separators_dots_and_reserved_names_are_escaped() {
        let path = LockPath::new("/p", "a/b", "../x y/é%#");
        assert_eq!(path.queue, "/p/a%2Fb/%2E%2E%2Fx%20y%2F%C3%A9%25%23");
        assert_eq!(path.queue.matches('/').count(), 3);
        assert_eq!(LockPath::new("/p", ".", "..").queue, "/p/%2E/%2E%2E");
        assert_eq!(
            LockPath::new("/p", "zookeeper", "k").queue,
            "/p/%7Aookeeper/k"
        );
    }

    #[test]
    fn long_and_empty_text_is_hashed_stably() {
        let long = "k".repeat(MAX_PLAIN_LEN + 1);
        assert_eq!(
            LockPath::new("/p", "n", &long).queue,
            format!("/p/n/#{}", sha256_hex(&long))
        );
        assert_eq!(
            LockPath::new("/p", "", "k").queue,
            format!("/p/#{}/k", sha256_hex(""))
        );
    }

    #[test]
    fn distinct_names_and_keys_never_share_a_queue() {
        let reserved = [("zookeeper", "k"), ("%7Aookeeper", "k")];
        distinct_paths(&reserved, |name, key| LockPath::new("/p", name, key).queue);
    }

    #[test]
    fn contenders_are_parsed_and_others_ignored() {
        let token = "0123456789abcdef0123456789abcdef";
        let name = format!("_c_{token}-lock-0000000042");
        let parsed = parse_contender(&name).unwrap();
        assert_eq!((parsed.token, parsed.sequence), (token, 42));
        for other in [
            "lock-0000000001",
            "_c_xyz-lock-1",
            "",
            "_c_",
            &format!("_c_{token}-lock-x"),
        ] {
            assert_eq!(parse_contender(other), None, "{other}");
        }
    }

    #[test]
    fn prefixes_are_normalized_and_checked() {
        assert_eq!(normalize_prefix("keyed-lock/"), "/keyed-lock");
        assert_eq!(normalize_prefix("/a/b"), "/a/b");
        assert!(check_prefix(&normalize_prefix("/")).is_err());
        assert!(check_prefix("/a//b").is_err());
        assert!(check_prefix("/a/../b").is_err());
        assert!(check_prefix("/zookeeper/x").is_err());
        assert!(check_prefix("/zookeeperish").is_ok());
    }
}
