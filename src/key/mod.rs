//! The lock key and the extractors that take it from a request.
//!
//! An extractor returns the raw key text; the layer then validates it with
//! [`Key::new`] and its length limit, so every extractor gets the same checks.
//!
//! ```
//! use http::{header::HeaderName, Request};
//! use tower_keyed_lock::{HeaderKey, Key, KeyExtractor, DEFAULT_MAX_KEY_LEN};
//!
//! let extractor = HeaderKey::new(HeaderName::from_static("idempotency-key"));
//! let (mut parts, ()) = Request::builder()
//!     .header("idempotency-key", "order-42")
//!     .body(())
//!     .unwrap()
//!     .into_parts();
//!
//! let raw = extractor.extract(&mut parts).unwrap();
//! let key = Key::new(&raw, DEFAULT_MAX_KEY_LEN).unwrap();
//! assert_eq!(key.as_str(), "order-42");
//! ```
//!
//! # Files
//!
//! - `mod.rs`: [`Key`] and [`KeyError`], the key every lock takes (no HTTP here).
//! - `text.rs`: the storage of a key's text, inline when short.
//! - `extract.rs`: [`KeyExtractor`] and the built-in extractors of a request's head.
//! - `json.rs`: `JsonBodyKey`, the key from a field of the buffered JSON body (the
//!   `json` feature).
//! - `axum.rs`: `PathParam` and the check for requests axum did not route: the only
//!   file in the crate that knows axum.

#[cfg(feature = "axum")]
mod axum;
mod extract;
#[cfg(feature = "json")]
mod json;
mod text;

use std::borrow::{Borrow, Cow};
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};

use text::Text;

#[cfg(feature = "axum")]
pub(crate) use self::axum::is_unrouted;
#[cfg(feature = "axum")]
pub use self::axum::PathParam;
pub use extract::{ExtensionKey, FnKey, HeaderKey, KeyExtractor};
#[cfg(feature = "json")]
pub use json::JsonBodyKey;

/// The default limit on a key's length, in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 256;

/// How many characters of a key [`Key::short`] shows.
const SHORT_CHARS: usize = 16;

/// A validated lock key: non-empty UTF-8 without control characters, within a
/// length limit. Cheap to clone: keys up to 40 bytes (ids, UUIDs) are stored inline,
/// without an allocation, longer ones in an `Arc<str>`.
///
/// `Display` writes the full key; `Debug` writes only the escaped [`Key::short`]
/// form, so a key logged with `{:?}` can neither flood nor forge a log line.
#[derive(Clone)]
pub struct Key(Text);

impl Key {
    /// Validates `s`: it must be non-empty, at most `max_len` bytes long and
    /// contain no character for which [`char::is_control`] is true.
    ///
    /// ```
    /// use tower_keyed_lock::{Key, KeyError};
    ///
    /// assert_eq!(Key::new("order-42", 256).unwrap().as_str(), "order-42");
    /// assert_eq!(Key::new("", 256), Err(KeyError::Empty));
    /// assert_eq!(Key::new("a\nb", 256), Err(KeyError::ControlChar));
    /// assert_eq!(Key::new("abc", 2), Err(KeyError::TooLong { len: 3, limit: 2 }));
    /// ```
    #[inline]
    pub fn new(s: &str, max_len: usize) -> Result<Key, KeyError> {
        if s.is_empty() {
            return Err(KeyError::Empty);
        }
        // Length first: it is O(1) and bounds the scan below.
        if s.len() > max_len {
            return Err(KeyError::TooLong {
                len: s.len(),
                limit: max_len,
            });
        }
        if has_control(s) {
            return Err(KeyError::ControlChar);
        }
        Ok(Key(Text::new(s)))
    }

    /// The key text.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// A short prefix of the key that is safe for logs and response bodies:
    /// at most 16 characters of the key, then `…` if it was longer.
    ///
    /// Every character outside printable ASCII, and `\`, `"` and `'`, is
    /// escaped as [`char::escape_default`] does (`\n`, `\u{1b}`, `\u{e9}`), so
    /// the result never contains a control character.
    ///
    /// ```
    /// use tower_keyed_lock::Key;
    ///
    /// let key = Key::new("café-0123456789abcdef", 256).unwrap();
    /// assert_eq!(key.short(), "caf\\u{e9}-0123456789a…");
    /// ```
    pub fn short(&self) -> String {
        let mut out = String::new();
        let mut chars = self.as_str().chars();
        for c in chars.by_ref().take(SHORT_CHARS) {
            out.extend(c.escape_default());
        }
        if chars.next().is_some() {
            out.push('…');
        }
        out
    }
}

/// Whether `s` has a character for which [`char::is_control`] is true (the C0 and C1
/// controls, U+0000–U+001F and U+007F–U+009F). A byte scan first, which the compiler
/// vectorizes: a C0 control or DEL is one byte below 0x20 or 0x7F, and a C1 control
/// is two bytes starting with 0xC2; only a key with such a byte is scanned by
/// character.
#[inline]
fn has_control(s: &str) -> bool {
    let suspect = s.bytes().fold(false, |suspect, b| {
        suspect | (b < 0x20) | (b == 0x7f) | (b == 0xc2)
    });
    suspect && s.chars().any(char::is_control)
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.short())
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

// Equality, order and hash are the text's, so `Borrow<str>` lookups agree with them.
impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Key) -> Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl Borrow<str> for Key {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for Key {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

/// Why no usable key could be taken from a request.
///
/// Messages never contain key text.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is absent from what the client sent: no such header (or a [`FnKey`]
    /// returned `None`). Answered with 400.
    Missing,
    /// The key source that the server controls is absent: the route has no such path
    /// parameter, or no layer inserted the extension. A server bug, answered with 500
    /// and logged; `source` names the parameter or type, never key text.
    Misconfigured {
        /// What the key should have come from, such as ``path parameter `order_id` ``.
        source: Cow<'static, str>,
    },
    /// The key header appears more than once: the lock would take one value while the
    /// application may read another.
    Repeated,
    /// The key is the empty string.
    Empty,
    /// The key is not valid UTF-8. For [`HeaderKey`] this also covers header
    /// values with bytes other than visible ASCII.
    NotUtf8,
    /// The key contains a control character.
    ControlChar,
    /// The request body that should hold the key is not JSON (`JsonBodyKey`).
    NotJson,
    /// The JSON value that should be the key is neither a string nor an integer: a
    /// fraction, a boolean, `null`, an object or an array (`JsonBodyKey`).
    NotText,
    /// The key is longer than the limit.
    TooLong {
        /// The key's length in bytes.
        len: usize,
        /// The limit in bytes.
        limit: usize,
    },
}

impl KeyError {
    /// `true` when the client sent no key, `false` when it sent an unusable one
    /// (the `missing_key` and `invalid_key` rejection reasons) or the server is
    /// misconfigured.
    pub fn is_missing(&self) -> bool {
        matches!(self, KeyError::Missing)
    }

    /// `true` when the key is absent, whoever's fault that is: the requests that
    /// [`allow_missing_key`](crate::KeyedLockLayer::allow_missing_key) lets through.
    pub fn is_absent(&self) -> bool {
        matches!(self, KeyError::Missing | KeyError::Misconfigured { .. })
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Missing => f.write_str("the request carries no lock key"),
            KeyError::Misconfigured { source } => {
                write!(
                    f,
                    "the server is misconfigured: the request has no {source}"
                )
            }
            KeyError::Repeated => f.write_str("the lock key header appears more than once"),
            KeyError::Empty => f.write_str("the lock key is empty"),
            KeyError::NotUtf8 => f.write_str("the lock key is not valid text"),
            KeyError::ControlChar => f.write_str("the lock key contains a control character"),
            KeyError::NotJson => f.write_str("the request body is not valid JSON"),
            KeyError::NotText => {
                f.write_str("the lock key in the JSON body is neither a string nor an integer")
            }
            KeyError::TooLong { len, limit } => {
                write!(
                    f,
                    "the lock key is {len} bytes long, over the limit of {limit}"
                )
            }
        }
    }
}

impl std::error::Error for KeyError {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Builds a key without validation, to test `short()` on text that
    /// `Key::new` would refuse.
    fn raw_key(s: &str) -> Key {
        Key(Text::new(s))
    }

    #[test]
    fn key_new_accepts_and_rejects() {
        assert_eq!(Key::new("order-42", 256).unwrap().as_str(), "order-42");
        assert_eq!(Key::new("", 256), Err(KeyError::Empty));
        assert_eq!(Key::new("a\nb", 256), Err(KeyError::ControlChar));
        assert_eq!(Key::new("a\u{1b}[31m", 256), Err(KeyError::ControlChar));
        assert_eq!(Key::new("a\u{85}", 256), Err(KeyError::ControlChar));
        assert_eq!(
            Key::new("abcd", 3),
            Err(KeyError::TooLong { len: 4, limit: 3 })
        );
        // The limit counts bytes, not characters.
        assert_eq!(Key::new("ééé", 6).unwrap().as_str(), "ééé");
        assert_eq!(
            Key::new("ééé", 5),
            Err(KeyError::TooLong { len: 6, limit: 5 })
        );
    }

    #[test]
    fn every_control_character_is_found_by_the_byte_scan() {
        for c in (0..=0x10ffff).filter_map(char::from_u32) {
            let text = format!("k{c}k");
            assert_eq!(has_control(&text), c.is_control(), "{:?}", c);
        }
    }

    proptest! {
        /// The byte scan agrees with `char::is_control` on any text.
        #[test]
        fn the_byte_scan_is_char_is_control(text in any::<String>()) {
            prop_assert_eq!(has_control(&text), text.chars().any(char::is_control));
        }
    }

    #[test]
    fn key_error_kinds_and_messages() {
        assert!(KeyError::Missing.is_missing());
        for invalid in [
            KeyError::Empty,
            KeyError::NotUtf8,
            KeyError::ControlChar,
            KeyError::TooLong { len: 9, limit: 8 },
        ] {
            assert!(!invalid.is_missing());
            assert!(!invalid.to_string().is_empty());
        }
        assert_eq!(
            KeyError::TooLong { len: 9, limit: 8 }.to_string(),
            "the lock key is 9 bytes long, over the limit of 8"
        );
    }

    #[test]
    fn key_formatting_and_borrowing() {
        let key = Key::new("order-0123456789abcdef", 256).unwrap();
        assert_eq!(key.to_string(), "order-0123456789abcdef");
        assert_eq!(format!("{key:?}"), "\"order-0123456789…\"");
        let as_str: &str = key.borrow();
        assert_eq!(as_str, key.as_ref());
        // Borrow<str> lets a set of keys be queried with a &str.
        let set: std::collections::HashSet<Key> = [key.clone()].into();
        assert!(set.contains("order-0123456789abcdef"));
    }

    #[test]
    fn short_truncates_at_16_chars() {
        assert_eq!(raw_key("0123456789abcdef").short(), "0123456789abcdef");
        assert_eq!(raw_key("0123456789abcdefg").short(), "0123456789abcdef…");
        assert_eq!(raw_key("x").short(), "x");
    }

    #[test]
    fn short_escapes_what_could_break_a_log_line() {
        assert_eq!(raw_key("a\nb").short(), "a\\nb");
        assert_eq!(raw_key("say \"hi\"").short(), "say \\\"hi\\\"");
        assert_eq!(raw_key("a\\b").short(), "a\\\\b");
        assert_eq!(raw_key("café").short(), "caf\\u{e9}");
        assert_eq!(raw_key("\u{1b}[31mred").short(), "\\u{1b}[31mred");
        // Escapes do not count against the 16 characters.
        assert_eq!(raw_key("éééééééééééééééé").short(), "\\u{e9}".repeat(16));
    }

    /// Characters that exercise every validation branch: anything, C0 and C1
    /// controls, DEL, and multi-byte text.
    fn key_char() -> impl Strategy<Value = char> {
        prop_oneof![
            any::<char>(),
            prop::char::range('\0', '\u{1f}'),
            Just('\u{7f}'),
            prop::char::range('\u{80}', '\u{9f}'),
            prop::char::range('a', 'z'),
            Just('é'),
        ]
    }

    proptest! {
        #[test]
        fn key_new_accepts_exactly_valid_keys(
            chars in prop::collection::vec(key_char(), 0..40),
            limit in 0usize..80,
        ) {
            let s: String = chars.into_iter().collect();
            let valid = !s.is_empty()
                && s.len() <= limit
                && !s.chars().any(char::is_control);
            let result = Key::new(&s, limit);
            prop_assert_eq!(result.is_ok(), valid);
            if let Ok(key) = result {
                prop_assert_eq!(key.as_str(), s.as_str());
            }
        }

        #[test]
        fn short_is_bounded_and_control_free(
            chars in prop::collection::vec(key_char(), 1..40),
        ) {
            let s: String = chars.into_iter().collect();
            let short = raw_key(&s).short();
            prop_assert!(!short.chars().any(char::is_control));
            // Each source char escapes to at most 10 chars (`\u{10ffff}`).
            let shown = s.chars().count().min(SHORT_CHARS);
            prop_assert!(short.chars().count() <= shown * 10 + 1);
            prop_assert_eq!(short.ends_with('…'), s.chars().count() > SHORT_CHARS);
        }
    }
}
