//! [`KeyExtractor`] and the built-in extractors that take a key from a request's head:
//! a header, an extension, a function.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use http::header::HeaderName;
use http::request::Parts;

use super::{Key, KeyError};

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

    fn parts() -> Parts {
        Request::new(()).into_parts().0
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
}
