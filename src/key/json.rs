//! [`JsonBodyKey`]: the key is a field of the JSON request body, found by a JSON pointer
//! (RFC 6901), as webhook senders that put the event id only in the body need (Stripe's
//! `"id": "evt_…"`).

use std::borrow::Cow;
use std::sync::Arc;

use http::request::Parts;
use serde_json::Value;

use super::{KeyError, KeyExtractor};
use crate::buffer::BufferedBody;

/// What a request that reached the lock without a buffered body lacks: named in the
/// 500's `error` log.
const NOT_BUFFERED: &str =
    "buffered request body (put BufferRequestBodyLayer outside the lock to read the JSON key)";

/// The key is the value at a JSON pointer in the request body, e.g. `/id` for
/// `{"id": "evt_1", ...}` or `/data/object/id` deeper down.
///
/// The body must have been read by a [`BufferRequestBodyLayer`](crate::BufferRequestBodyLayer)
/// placed *outside* the lock, which leaves a [`BufferedBody`] in the request
/// extensions; the handler still gets the whole body. Without it the request gets 500
/// ([`KeyError::Misconfigured`], logged once per layer): the server is set up wrong,
/// not the client.
///
/// | the body | the key |
/// |---|---|
/// | a string at the pointer | the string (then checked as any key: not empty, within the length limit, no control character) |
/// | an integer at the pointer | its decimal text: `{"id": 42}` → `42` |
/// | nothing at the pointer | [`KeyError::Missing`] (400) |
/// | a fraction, `true`/`false`, `null`, an object or an array | [`KeyError::NotText`] (400) |
/// | not JSON | [`KeyError::NotJson`] (400) |
///
/// The pointer follows RFC 6901: `~1` stands for `/` and `~0` for `~` in a member
/// name, and a number selects an array element (`/items/0/id`).
///
/// ```
/// use bytes::Bytes;
/// use http::Request;
/// use tower_keyed_lock::{BufferedBody, JsonBodyKey, KeyExtractor};
///
/// let extractor = JsonBodyKey::new("/data/object/id");
/// let body = Bytes::from_static(br#"{"data":{"object":{"id":"pi_1"}}}"#);
/// let (mut parts, ()) = Request::new(()).into_parts();
/// parts.extensions.insert(BufferedBody::new(body));
/// assert_eq!(extractor.extract(&mut parts).unwrap(), "pi_1");
/// ```
#[derive(Clone, Debug)]
pub struct JsonBodyKey {
    pointer: Arc<str>,
}

impl JsonBodyKey {
    /// Uses the value at `pointer`.
    ///
    /// # Panics
    /// If `pointer` is not a JSON pointer: neither empty (the whole body) nor starting
    /// with `/`, or with a `~` not followed by `0` or `1`.
    pub fn new(pointer: impl Into<Arc<str>>) -> Self {
        let pointer = pointer.into();
        assert!(
            is_json_pointer(&pointer),
            "JsonBodyKey: {pointer:?} is not a JSON pointer (RFC 6901): it must be empty or \
             start with `/`, and `~` must be followed by `0` or `1` (write `/id`, not `id`)"
        );
        JsonBodyKey { pointer }
    }

    /// The pointer this extractor reads.
    pub fn pointer(&self) -> &str {
        &self.pointer
    }
}

/// Whether `pointer` is an RFC 6901 JSON pointer.
fn is_json_pointer(pointer: &str) -> bool {
    if !(pointer.is_empty() || pointer.starts_with('/')) {
        return false;
    }
    let mut chars = pointer.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0' | '1')) {
            return false;
        }
    }
    true
}

impl KeyExtractor for JsonBodyKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError> {
        let body = parts
            .extensions
            .get::<BufferedBody>()
            .ok_or(KeyError::Misconfigured {
                source: Cow::Borrowed(NOT_BUFFERED),
            })?;
        // The body is bounded by the buffering layer's limit, and serde_json bounds its
        // nesting depth (128), so a hostile body costs at most one bounded parse.
        let json: Value = serde_json::from_slice(body.bytes()).map_err(|_| KeyError::NotJson)?;
        match json.pointer(&self.pointer) {
            None => Err(KeyError::Missing),
            Some(Value::String(text)) => Ok(Cow::Owned(text.clone())),
            Some(Value::Number(number)) if number.is_i64() || number.is_u64() => {
                Ok(Cow::Owned(number.to_string()))
            }
            Some(_) => Err(KeyError::NotText),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::DEFAULT_MAX_KEY_LEN;
    use bytes::Bytes;
    use http::Request;

    fn parts_with(body: &'static str) -> Parts {
        let (mut parts, ()) = Request::new(()).into_parts();
        parts
            .extensions
            .insert(BufferedBody::new(Bytes::from_static(body.as_bytes())));
        parts
    }

    fn key(pointer: &str, body: &'static str) -> Result<String, KeyError> {
        let key = JsonBodyKey::new(pointer).extract_key(&mut parts_with(body), 24)?;
        Ok(key.as_str().to_owned())
    }

    #[test]
    fn a_string_or_an_integer_is_the_key() {
        assert_eq!(
            key("/id", r#"{"id":"evt_1","created":1}"#).unwrap(),
            "evt_1"
        );
        assert_eq!(key("/id", r#"{"id":42}"#).unwrap(), "42");
        assert_eq!(key("/id", r#"{"id":-7}"#).unwrap(), "-7");
        assert_eq!(
            key("/id", r#"{"id":18446744073709551615}"#).unwrap(),
            "18446744073709551615"
        );
        assert_eq!(key("", r#""whole""#).unwrap(), "whole");
    }

    #[test]
    fn pointer_escapes_and_array_indices() {
        let body = r#"{"a/b":{"m~n":"slash-tilde"},"items":[{"id":"first"},{"id":"second"}]}"#;
        assert_eq!(key("/a~1b/m~0n", body).unwrap(), "slash-tilde");
        assert_eq!(key("/items/1/id", body).unwrap(), "second");
        assert_eq!(key("/items/0/id", body).unwrap(), "first");
        // `~01` is `~1` unescaped once: a member named `~1`, not `/`.
        assert_eq!(
            key("/~01", r#"{"~1":"literal","/":"wrong"}"#).unwrap(),
            "literal"
        );
        assert_eq!(key("/items/2/id", body), Err(KeyError::Missing));
        // RFC 6901: no leading zeros in an index.
        assert_eq!(key("/items/01/id", body), Err(KeyError::Missing));
    }

    #[test]
    fn unusable_values_and_bodies_are_refused() {
        assert_eq!(key("/id", r#"{"other":"x"}"#), Err(KeyError::Missing));
        assert_eq!(key("/id", r#"{"id":""}"#), Err(KeyError::Empty));
        assert_eq!(
            key("/id", r#"{"id":"0123456789abcdef012345678"}"#),
            Err(KeyError::TooLong { len: 25, limit: 24 })
        );
        assert_eq!(key("/id", r#"{"id":"a\nb"}"#), Err(KeyError::ControlChar));
        for value in ["1.5", "true", "null", "{}", "[]", r#"{"id":"x"}"#] {
            let body: &'static str = Box::leak(format!(r#"{{"id":{value}}}"#).into_boxed_str());
            assert_eq!(key("/id", body), Err(KeyError::NotText), "{value}");
        }
        for body in ["", "{", "id=evt_1", "\u{0}", r#"{"id":"evt_1"} trailing"#] {
            assert_eq!(key("/id", body), Err(KeyError::NotJson), "{body:?}");
        }
    }

    #[test]
    fn an_unbuffered_body_is_a_misconfiguration() {
        let (mut parts, ()) = Request::new(()).into_parts();
        let error = JsonBodyKey::new("/id")
            .extract_key(&mut parts, DEFAULT_MAX_KEY_LEN)
            .unwrap_err();
        assert!(matches!(error, KeyError::Misconfigured { .. }), "{error:?}");
        assert!(
            error.to_string().contains("BufferRequestBodyLayer"),
            "{error}"
        );
    }

    #[test]
    fn pointers_are_checked_when_the_extractor_is_made() {
        for good in ["", "/", "/id", "/a~0b/~1", "/items/0"] {
            assert!(is_json_pointer(good), "{good}");
        }
        for bad in ["id", "~0", "/a~", "/a~2", "#/id"] {
            assert!(!is_json_pointer(bad), "{bad}");
        }
        let panic = std::panic::catch_unwind(|| JsonBodyKey::new("id")).unwrap_err();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(message.contains("not a JSON pointer"), "{message}");
        assert_eq!(JsonBodyKey::new("/id").pointer(), "/id");
    }
}
