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

mod text;

use std::borrow::{Borrow, Cow};
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::sync::Arc;

use text::Text;

use http::header::HeaderName;
use http::request::Parts;

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
        if s.chars().any(char::is_control) {
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

/// Takes the lock key from a request's head.
///
/// Implement it for a custom key source; the built-in ones are [`HeaderKey`],
/// [`ExtensionKey`], [`FnKey`] and (with the `axum` feature) `PathParam`.
///
/// ```
/// use std::borrow::Cow;
/// use http::request::Parts;
/// use tower_keyed_lock::{KeyError, KeyExtractor};
///
/// /// Serializes requests per path, e.g. `/reports/daily`.
/// #[derive(Clone)]
/// struct ByPath;
///
/// impl KeyExtractor for ByPath {
///     fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError> {
///         Ok(Cow::Borrowed(parts.uri.path()))
///     }
/// }
/// ```
pub trait KeyExtractor: Clone + Send + Sync + 'static {
    /// Returns the raw key; the layer validates it with [`Key::new`] and its
    /// length limit.
    ///
    /// `parts` is mutable only because some extractors (axum's path
    /// parameters) need `&mut`; an extractor should not change it.
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError>;

    /// Extracts and validates the key in one step: what the layer calls. The default
    /// validates what [`extract`](Self::extract) returns; an extractor that would
    /// otherwise return an owned copy overrides it to skip that copy.
    fn extract_key(&self, parts: &mut Parts, max_len: usize) -> Result<Key, KeyError> {
        Key::new(&self.extract(parts)?, max_len)
    }
}

/// The key is the named axum path parameter, e.g. `order_id` in
/// `/orders/{order_id}`.
///
/// A route without that parameter, or a request not routed by axum, gives
/// [`KeyError::Misconfigured`] (a server bug: 500); a parameter that is not UTF-8 once
/// percent-decoded gives [`KeyError::NotUtf8`].
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_keyed_lock::PathParam;
///
/// let extractor = PathParam::new("order_id");
/// // Used on routes such as:
/// let app: Router = Router::new().route("/orders/{order_id}/pay", post(|| async {}));
/// # let _ = (extractor, app);
/// ```
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Clone, Debug)]
pub struct PathParam {
    name: Arc<str>,
}

#[cfg(feature = "axum")]
impl PathParam {
    /// Uses the path parameter called `name`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        PathParam { name: name.into() }
    }
}

#[cfg(feature = "axum")]
impl PathParam {
    /// Runs `with` on the parameter's value.
    fn with_value<R>(
        &self,
        parts: &mut Parts,
        with: impl FnOnce(&str) -> R,
    ) -> Result<R, KeyError> {
        use axum::extract::path::RawPathParams;
        use axum::extract::rejection::RawPathParamsRejection;
        use axum::extract::FromRequestParts;
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        // The extractor only reads the request extensions: its future is ready
        // on the first poll, so no runtime is needed. Pending is never expected.
        let future = std::pin::pin!(RawPathParams::from_request_parts(parts, &()));
        let params = match future.poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(params)) => params,
            Poll::Ready(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => {
                return Err(KeyError::NotUtf8)
            }
            // MissingPathParams (not routed by axum) and anything newer.
            Poll::Ready(Err(_)) | Poll::Pending => return Err(self.misconfigured()),
        };
        params
            .iter()
            .find(|(name, _)| *name == &*self.name)
            .map(|(_, value)| with(value))
            .ok_or_else(|| self.misconfigured())
    }

    fn misconfigured(&self) -> KeyError {
        KeyError::Misconfigured {
            source: Cow::Owned(format!("path parameter `{}`", self.name)),
        }
    }
}

/// Whether axum routed `parts` to a fallback: the router ran (it inserted path
/// parameters, possibly none) but no route matched (no `MatchedPath`). Such a request
/// passes the layer untouched, so `Router::layer` keeps the fallback's 404.
#[cfg(feature = "axum")]
pub(crate) fn is_unrouted(parts: &mut Parts) -> bool {
    use axum::extract::{FromRequestParts, MatchedPath, RawPathParams};
    use std::future::Future;
    use std::task::{Context, Waker};

    if parts.extensions.get::<MatchedPath>().is_some() {
        return false;
    }
    // Ready on the first poll: it only reads the extensions.
    let params = std::pin::pin!(RawPathParams::from_request_parts(parts, &()));
    let routed = params.poll(&mut Context::from_waker(Waker::noop()));
    matches!(routed, std::task::Poll::Ready(Ok(_)))
}

#[cfg(feature = "axum")]
impl KeyExtractor for PathParam {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError> {
        self.with_value(parts, |value| Cow::Owned(value.to_owned()))
    }

    fn extract_key(&self, parts: &mut Parts, max_len: usize) -> Result<Key, KeyError> {
        // The parameters are owned by a temporary: validate in place, copy once.
        self.with_value(parts, |value| Key::new(value, max_len))?
    }
}

/// The key is the value of a request header, e.g. `Idempotency-Key`.
///
/// An absent header gives [`KeyError::Missing`]; a value with bytes other than
/// visible ASCII gives [`KeyError::NotUtf8`]; the header more than once gives
/// [`KeyError::Repeated`].
///
/// ```
/// use http::{header::HeaderName, Request};
/// use tower_keyed_lock::{HeaderKey, KeyExtractor};
///
/// let extractor = HeaderKey::new(HeaderName::from_static("idempotency-key"));
/// let (mut parts, ()) = Request::new(()).into_parts();
/// assert!(extractor.extract(&mut parts).unwrap_err().is_missing());
/// ```
#[derive(Clone, Debug)]
pub struct HeaderKey {
    name: HeaderName,
}

impl HeaderKey {
    /// Uses the header called `name`.
    pub fn new(name: HeaderName) -> Self {
        HeaderKey { name }
    }
}

impl KeyExtractor for HeaderKey {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError> {
        let mut values = parts.headers.get_all(&self.name).into_iter();
        let value = values.next().ok_or(KeyError::Missing)?;
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        let text = value.to_str().map_err(|_| KeyError::NotUtf8)?;
        Ok(Cow::Borrowed(text))
    }
}

/// The key is a value of type `T` in the request extensions, e.g. a `UserId`
/// that an authentication layer inserted; the key text is its `to_string()`.
///
/// An absent value gives [`KeyError::Misconfigured`] naming `T`: the layer that should
/// have inserted it is missing or runs in the wrong order (a server bug: 500).
///
/// ```
/// use std::fmt;
/// use http::Request;
/// use tower_keyed_lock::{ExtensionKey, KeyExtractor};
///
/// #[derive(Clone)]
/// struct UserId(u64);
///
/// impl fmt::Display for UserId {
///     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
///         write!(f, "user-{}", self.0)
///     }
/// }
///
/// let extractor = ExtensionKey::<UserId>::new();
/// let (mut parts, ()) = Request::new(()).into_parts();
/// parts.extensions.insert(UserId(7));
/// assert_eq!(extractor.extract(&mut parts).unwrap(), "user-7");
/// ```
pub struct ExtensionKey<T> {
    // `fn() -> T`: the extractor holds no `T`, so it is Send, Sync, Clone and
    // Debug whatever `T` is.
    _type: PhantomData<fn() -> T>,
}

impl<T> ExtensionKey<T> {
    /// Uses the extension of type `T`.
    pub fn new() -> Self {
        ExtensionKey { _type: PhantomData }
    }
}

impl<T> Default for ExtensionKey<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for ExtensionKey<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for ExtensionKey<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ExtensionKey")
            .field(&std::any::type_name::<T>())
            .finish()
    }
}

impl<T> KeyExtractor for ExtensionKey<T>
where
    T: fmt::Display + Send + Sync + 'static,
{
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError> {
        let value = parts
            .extensions
            .get::<T>()
            .ok_or_else(|| KeyError::Misconfigured {
                source: Cow::Owned(format!("extension `{}`", std::any::type_name::<T>())),
            })?;
        Ok(Cow::Owned(value.to_string()))
    }
}

/// The key is whatever a function computes from the request head; `None`
/// gives [`KeyError::Missing`].
///
/// ```
/// use http::{request::Parts, Request};
/// use tower_keyed_lock::{FnKey, KeyExtractor};
///
/// // The tenant is the first path segment: `/acme/reports` → `acme`.
/// let extractor = FnKey::new(|parts: &Parts| {
///     parts.uri.path().split('/').nth(1).map(str::to_owned)
/// });
/// let (mut parts, ()) = Request::builder().uri("/acme/reports").body(()).unwrap().into_parts();
/// assert_eq!(extractor.extract(&mut parts).unwrap(), "acme");
/// ```
#[derive(Clone)]
pub struct FnKey<F> {
    f: F,
}

impl<F> FnKey<F>
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    /// Uses `f` to compute the key.
    pub fn new(f: F) -> Self {
        FnKey { f }
    }
}

impl<F> fmt::Debug for FnKey<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnKey").finish_non_exhaustive()
    }
}

impl<F> KeyExtractor for FnKey<F>
where
    F: Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError> {
        (self.f)(parts).map(Cow::Owned).ok_or(KeyError::Missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, Request};
    use proptest::prelude::*;

    fn parts() -> Parts {
        Request::new(()).into_parts().0
    }

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

    #[test]
    fn header_key_refuses_a_repeated_header() {
        let name = HeaderName::from_static("idempotency-key");
        let mut parts = parts();
        parts
            .headers
            .append(&name, HeaderValue::from_static("first"));
        parts
            .headers
            .append(&name, HeaderValue::from_static("second"));
        let extractor = HeaderKey::new(name.clone());
        assert_eq!(extractor.extract(&mut parts), Err(KeyError::Repeated));
        parts.headers.remove(&name);
        parts
            .headers
            .insert(&name, HeaderValue::from_static("only"));
        assert!(matches!(
            extractor.extract(&mut parts),
            Ok(Cow::Borrowed("only"))
        ));
    }

    #[test]
    fn header_key_missing_and_not_visible_ascii() {
        let name = HeaderName::from_static("idempotency-key");
        let extractor = HeaderKey::new(name.clone());
        let mut parts = parts();
        assert_eq!(extractor.extract(&mut parts), Err(KeyError::Missing));

        // UTF-8 bytes in a header value are not visible ASCII.
        let value = HeaderValue::from_bytes("café".as_bytes()).unwrap();
        parts.headers.insert(&name, value);
        assert_eq!(extractor.extract(&mut parts), Err(KeyError::NotUtf8));

        parts
            .headers
            .insert(&name, HeaderValue::from_bytes(b"\xff").unwrap());
        assert_eq!(extractor.extract(&mut parts), Err(KeyError::NotUtf8));
    }

    #[derive(Clone)]
    struct UserId(u64);

    impl fmt::Display for UserId {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "user-{}", self.0)
        }
    }

    #[test]
    fn extension_key_present_and_absent() {
        let extractor = ExtensionKey::<UserId>::default();
        let mut parts = parts();
        let absent = extractor.extract(&mut parts).unwrap_err();
        assert!(absent.is_absent() && !absent.is_missing());
        assert!(absent.to_string().contains("UserId"), "{absent}");
        parts.extensions.insert(UserId(7));
        assert_eq!(extractor.clone().extract(&mut parts).unwrap(), "user-7");
        assert!(format!("{extractor:?}").contains("UserId"));
    }

    #[test]
    fn fn_key_some_and_none() {
        let extractor = FnKey::new(|parts: &Parts| parts.uri.query().map(str::to_owned));
        let (mut with_query, ()) = Request::builder()
            .uri("/x?tenant")
            .body(())
            .unwrap()
            .into_parts();
        assert_eq!(extractor.extract(&mut with_query).unwrap(), "tenant");
        assert_eq!(extractor.extract(&mut parts()), Err(KeyError::Missing));
        assert_eq!(format!("{extractor:?}"), "FnKey { .. }");
    }

    #[cfg(feature = "axum")]
    mod path_param {
        use super::super::*;
        use axum::body::Body;
        use axum::extract::Request;
        use axum::middleware::{self, Next};
        use axum::response::Response;
        use axum::routing::get;
        use axum::Router;
        use http_body_util::BodyExt;
        use tower::ServiceExt;

        /// Routes `uri` through `/orders/{order_id}` and returns what
        /// `PathParam::new(param)` extracted there, as `Ok(key)` or `Err(error)`.
        async fn extract_through_router(param: &'static str, uri: &str) -> String {
            let extract_into_body = move |req: Request, _next: Next| async move {
                let (mut parts, _body) = req.into_parts();
                let result = PathParam::new(param).extract(&mut parts);
                Response::new(Body::from(format!("{result:?}")))
            };
            let app = Router::new()
                .route("/orders/{order_id}", get(|| async { "handler" }))
                .route_layer(middleware::from_fn(extract_into_body));
            let request = Request::builder().uri(uri).body(Body::empty()).unwrap();
            let response = app.oneshot(request).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            String::from_utf8(body.to_vec()).unwrap()
        }

        #[tokio::test]
        async fn present_param_is_percent_decoded() {
            assert_eq!(
                extract_through_router("order_id", "/orders/42").await,
                "Ok(\"42\")"
            );
            assert_eq!(
                extract_through_router("order_id", "/orders/caf%C3%A9").await,
                "Ok(\"café\")"
            );
        }

        #[tokio::test]
        async fn invalid_utf8_param_is_not_utf8() {
            assert_eq!(
                extract_through_router("order_id", "/orders/%FF").await,
                "Err(NotUtf8)"
            );
        }

        #[tokio::test]
        async fn unknown_param_name_is_a_misconfiguration() {
            assert_eq!(
                extract_through_router("user_id", "/orders/42").await,
                "Err(Misconfigured { source: \"path parameter `user_id`\" })"
            );
        }

        #[test]
        fn request_not_routed_by_axum_is_a_misconfiguration() {
            let (mut parts, ()) = http::Request::new(()).into_parts();
            let error = PathParam::new("order_id").extract(&mut parts).unwrap_err();
            assert!(matches!(error, KeyError::Misconfigured { .. }), "{error:?}");
            assert!(
                !crate::key::is_unrouted(&mut parts),
                "not routed by axum at all"
            );
        }
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
