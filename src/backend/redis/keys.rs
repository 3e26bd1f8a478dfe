//! The names of a lock's Redis keys (see [Redis keys](super#redis-keys)).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use redis::{RedisWrite, ToRedisArgs};

use crate::backend::ttl::sha256_hex;
use crate::backend::LockMode;

/// Names and keys longer than this are hashed.
const MAX_PLAIN_LEN: usize = 64;

/// The Redis keys of one lock, in one hash slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::backend) struct RedisKeys {
    pub(in crate::backend) lock: Arc<str>,
    /// The other keys' names, one after the other (each the lock's hash tag and a
    /// suffix of [`SUFFIXES`]): one allocation for all of them, on every lock's path.
    names: String,
    /// The length of the hash tag each name starts with.
    tag_len: usize,
    /// How the acquisition these keys were made for holds the key.
    pub(super) mode: LockMode,
    /// A replay record each attempt looks for first (an exclusive acquisition only):
    /// when it is stored, the key is not taken.
    pub(super) record: Option<String>,
}

/// The suffixes of the keys beside the lock, in the order of [`RedisKeys::names`].
const SUFFIXES: [&str; 6] = [
    ":waiting", ":readers", ":permits", ":intent", ":queue", ":holder",
];

impl RedisKeys {
    /// `prefix` is normalized (empty or ending with `:`, no braces).
    pub(in crate::backend) fn new(prefix: &str, name: &str, key: &str) -> Self {
        use std::fmt::Write;
        let (name, key) = (component(name), component(key));
        let tag_len = prefix.len() + name.len() + key.len() + 3;
        let suffixes: usize = SUFFIXES.iter().map(|suffix| suffix.len()).sum();
        let mut names = String::with_capacity(SUFFIXES.len() * tag_len + suffixes);
        for suffix in SUFFIXES {
            // Writing to a String cannot fail.
            let _ = write!(names, "{{{prefix}{name}:{key}}}{suffix}");
        }
        let lock = format!("{}:lock", &names[..tag_len]).into();
        Self {
            lock,
            names,
            tag_len,
            mode: LockMode::Exclusive,
            record: None,
        }
    }

    /// The key with suffix number `index` of [`SUFFIXES`].
    fn name(&self, index: usize) -> &str {
        let before: usize = SUFFIXES[..index].iter().map(|suffix| suffix.len()).sum();
        let start = index * self.tag_len + before;
        &self.names[start..start + self.tag_len + SUFFIXES[index].len()]
    }

    /// Present while some instance waits for the lock: its release must publish.
    pub(super) fn waiting(&self) -> &str {
        self.name(0)
    }

    /// Shared holders: a sorted set of tokens scored by expiry (server ms).
    pub(super) fn readers(&self) -> &str {
        self.name(1)
    }

    /// Permit holders, the same way.
    pub(super) fn permits(&self) -> &str {
        self.name(2)
    }

    /// Writers waiting for the key, the same way: while one is there, no new reader
    /// enters (writers are not starved).
    pub(super) fn intent(&self) -> &str {
        self.name(3)
    }

    /// Writers among them that take a grant from a release: token → the lease, fence
    /// TTL and instance id to grant it with.
    pub(super) fn queue(&self) -> &str {
        self.name(4)
    }

    /// Who was granted the lock last, written by the grant itself: token, grant time,
    /// fencing token, instance id. It outlives the lock by the record window, and
    /// carries the last fencing token for the next grant.
    pub(in crate::backend) fn holder(&self) -> &str {
        self.name(5)
    }

    /// How many bytes the names of these keys take: what a command naming them all
    /// needs.
    pub(in crate::backend) fn names_len(&self) -> usize {
        self.lock.len() + self.names.len()
    }

    /// The replay record of `scope` for this lock: beside its keys, in its hash slot.
    #[cfg(feature = "replay")]
    pub(in crate::backend) fn record_of(&self, scope: &str) -> String {
        let tag = self.lock.strip_suffix(":lock").unwrap_or(&self.lock);
        format!("{tag}:replay:{scope}")
    }

    /// The same keys, for an exclusive acquisition that looks for `record` first.
    #[cfg(feature = "replay")]
    pub(super) fn looking_for(mut self, record: String) -> Self {
        self.record = Some(record);
        self
    }

    /// The same keys, for an acquisition in `mode`.
    pub(super) fn with_mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// The sorted set of holders that a shared or permit lease is in; `None` for an
    /// exclusive one, held in `lock`.
    pub(super) fn holders(&self) -> Option<&str> {
        match self.mode {
            LockMode::Exclusive => None,
            LockMode::Shared => Some(self.readers()),
            LockMode::Permit { .. } => Some(self.permits()),
        }
    }

    /// The mark a give-back leaves when it finds the lock not held by `token`: an
    /// attempt of that token still on its way (on a connection since replaced) then
    /// grants nothing. Under the lock's hash tag, so a cluster keeps it on its slot.
    pub(in crate::backend) fn given_back<'a>(&'a self, token: &'a str) -> GivenBack<'a> {
        GivenBack {
            lock: &self.lock,
            token,
        }
    }
}

/// The name of a token's given-back mark (see [`RedisKeys::given_back`]), written
/// straight into the command that names it.
pub(in crate::backend) struct GivenBack<'a> {
    lock: &'a str,
    token: &'a str,
}

impl fmt::Display for GivenBack<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:given-back:{}", self.lock, self.token)
    }
}

impl ToRedisArgs for GivenBack<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        out.write_arg_fmt(self);
    }
}

/// A layer name or request key as it appears in a Redis key: as-is when short and
/// plain, else `#` + hex SHA-256. Plain text has no `#`, so the forms never collide.
fn component(text: &str) -> Cow<'_, str> {
    let plain = |b: u8| b.is_ascii_alphanumeric() || b"-_.@+=/~,".contains(&b);
    if !text.is_empty() && text.len() <= MAX_PLAIN_LEN && text.bytes().all(plain) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(format!("#{}", sha256_hex(text)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_and_keys_are_kept() {
        let keys = RedisKeys::new("keyed-lock:", "orders", "order-42");
        assert_eq!(&*keys.lock, "{keyed-lock:orders:order-42}:lock");
        assert_eq!(keys.waiting(), "{keyed-lock:orders:order-42}:waiting");
        assert_eq!(keys.readers(), "{keyed-lock:orders:order-42}:readers");
        assert_eq!(keys.permits(), "{keyed-lock:orders:order-42}:permits");
        assert_eq!(keys.intent(), "{keyed-lock:orders:order-42}:intent");
        assert_eq!(keys.queue(), "{keyed-lock:orders:order-42}:queue");
        assert_eq!(keys.holder(), "{keyed-lock:orders:order-42}:holder");
        let keys = RedisKeys::new("", "a", "b");
        assert_eq!(&*keys.lock, "{a:b}:lock");
    }

    #[test]
    fn a_given_back_mark_shares_the_lock_hash_tag() {
        let keys = RedisKeys::new("keyed-lock:", "orders", "order-42");
        let mark = keys.given_back("0123abcd").to_string();
        assert_eq!(
            mark,
            "{keyed-lock:orders:order-42}:lock:given-back:0123abcd"
        );
        // Redis Cluster hashes only what is inside the first braces.
        assert_eq!(mark.split('}').next(), keys.lock.split('}').next());
    }

    #[test]
    fn odd_or_long_text_is_hashed_with_a_marker() {
        for odd in ["a:b", "{x}", "*", "a b", "é", "#abc", &"k".repeat(65), ""] {
            assert_eq!(component(odd), format!("#{}", sha256_hex(odd)), "{odd:?}");
        }
        assert_eq!(component(&"k".repeat(64)), "k".repeat(64));
    }

    #[test]
    fn names_and_keys_cannot_reach_each_other() {
        let triples = [
            ("p:", "a", "b:c"),
            ("p:", "a:b", "c"),
            ("p:a:", "b", "c"),
            ("p:", "a", "b"),
            ("", "p", "a:b"),
            ("p:a:b:", "c", "d"),
        ];
        let mut seen = std::collections::HashSet::new();
        for (prefix, name, key) in triples {
            let keys = RedisKeys::new(prefix, name, key);
            assert!(seen.insert(keys.lock.clone()), "{prefix} {name} {key}");
            let tag = keys.lock.strip_suffix(":lock").unwrap();
            assert_eq!(tag.matches('{').count(), 1);
            assert_eq!(tag.matches('}').count(), 1);
        }
    }
}
