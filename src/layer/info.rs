//! What the handler learns about the lock it runs under.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::LeaseSignal;
use crate::key::Key;

/// Put in the request extensions by the layer before the inner service is called.
///
/// With the `axum` feature it is an extractor (`Extension<LockInfo>` works too):
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_keyed_lock::{KeyedLockLayer, LockInfo};
///
/// async fn pay(lock: LockInfo) -> String {
///     format!("paid {} after waiting {:?}", lock.key(), lock.waited())
/// }
///
/// let app: Router = Router::new()
///     .route("/orders/{order_id}/pay", post(pay))
///     .layer(KeyedLockLayer::by_path("order_id"));
/// ```
///
/// When several lock layers wrap one handler, it sees the innermost layer's `LockInfo`.
#[derive(Clone)]
pub struct LockInfo {
    /// The layer (and so the table) that holds the key.
    layer: LayerTag,
    key: Key,
    waited: Duration,
    shared: bool,
    /// Boxed, as only a distributed backend sets it: every request moves its
    /// `LockInfo` into the extensions.
    remote: Option<Box<Remote>>,
    /// The `LockInfo` of an outer lock layer on the same request, if any.
    outer: Option<Box<LockInfo>>,
}

impl LockInfo {
    /// A key taken at once in this process: no wait, no backend.
    pub(crate) fn local(layer: &LayerTag, key: Key, shared: bool) -> Self {
        Self {
            layer: layer.clone(),
            key,
            waited: Duration::ZERO,
            shared,
            remote: None,
            outer: None,
        }
    }

    pub(crate) fn new(
        layer: &LayerTag,
        key: Key,
        waited: Duration,
        shared: bool,
        fencing_token: Option<u64>,
        lease: Option<LeaseSignal>,
    ) -> Self {
        Self {
            layer: layer.clone(),
            key,
            waited,
            shared,
            remote: (fencing_token.is_some() || lease.is_some()).then(|| {
                Box::new(Remote {
                    fencing_token,
                    lease,
                })
            }),
            outer: None,
        }
    }

    /// Puts `self` into `extensions`, keeping the `LockInfo` of an outer lock layer
    /// reachable, so an inner layer knows every key the request already holds.
    pub(crate) fn insert_into(self, extensions: &mut http::Extensions) {
        if let Some(outer) = extensions.insert(self) {
            let inner = extensions.get_mut::<LockInfo>().expect("just inserted");
            inner.outer = Some(Box::new(outer));
        }
    }

    /// Whether this request already holds `key` in the table of the layer `layer`
    /// names (the same layer value applied twice on its path): then it must not wait
    /// for itself.
    pub(crate) fn holds(&self, layer: &LayerTag, key: &Key) -> bool {
        let mut info = Some(self);
        while let Some(held) = info {
            if held.layer.id == layer.id && held.key == *key {
                return true;
            }
            info = held.outer.as_deref();
        }
        false
    }

    /// The [`name`](crate::KeyedLockLayer::name) of the layer that holds the key (it
    /// namespaces the key at a distributed backend).
    pub fn layer(&self) -> &str {
        self.layer.name.as_str()
    }

    /// The key this request holds.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// The layer's name and the key, shared rather than copied.
    #[cfg(feature = "replay")]
    pub(crate) fn layer_and_key(&self) -> (&LayerName, &Key) {
        (&self.layer.name, &self.key)
    }

    /// Whether the request holds its key shared with others
    /// ([`shared_methods`](crate::KeyedLockLayer::shared_methods)) rather than alone.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// How long the request waited for the key (zero when it was free).
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// A number that grows with every grant of this key, for fencing writes to storage.
    /// `None` in process: only distributed backends issue fencing tokens.
    ///
    /// A request holding its key [shared](Self::is_shared) takes no token of its own:
    /// it gets the last writer's (Redis) or one at least that and below the next
    /// writer's (PostgreSQL) — what it reads was written under it — or `None` before
    /// any writer.
    pub fn fencing_token(&self) -> Option<u64> {
        self.remote.as_ref().and_then(|remote| remote.fencing_token)
    }

    /// The lost-lease signal of the distributed lease this request holds; `None` in
    /// process (an in-process lock cannot be lost).
    pub fn lease(&self) -> Option<&LeaseSignal> {
        self.remote
            .as_ref()
            .and_then(|remote| remote.lease.as_ref())
    }

    /// Whether the distributed lease was lost: another instance may now hold the key.
    /// Always false in process.
    pub fn is_lease_lost(&self) -> bool {
        self.lease().is_some_and(LeaseSignal::is_lost)
    }
}

/// Put in the request extensions, instead of a [`LockInfo`], when the layer lets a
/// request through without a key
/// ([`allow_missing_key`](crate::KeyedLockLayer::allow_missing_key)): a replay layer
/// inside then runs the request unreplayed, while a request that carries neither never
/// passed a lock layer (a replay layer stacked outside the lock, which cannot work).
#[cfg(feature = "replay")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct PassedWithoutKey;

/// A handler behind the layer can take `LockInfo` as an argument. On a route that is
/// not behind a lock layer that is a server misconfiguration: 500, with a
/// `problem+json` body. Where a request may pass unlocked (with
/// [`allow_missing_key`](crate::KeyedLockLayer::allow_missing_key)), take
/// `Option<LockInfo>`.
#[cfg(feature = "axum")]
mod extractor {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicBool, Ordering};

    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use http::request::Parts;

    use super::LockInfo;
    use crate::reject::Rejection;

    impl<S: Send + Sync> FromRequestParts<S> for LockInfo {
        type Rejection = Rejection;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Rejection> {
            static LOGGED: AtomicBool = AtomicBool::new(false);
            let info = parts.extensions.get::<LockInfo>().cloned();
            info.ok_or_else(|| {
                if !LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        "a handler takes LockInfo, but its route is not behind a KeyedLockLayer"
                    );
                }
                Rejection::misconfigured(
                    "the handler expects a held key, but its route is not behind a lock layer",
                )
            })
        }
    }

    /// `Option<LockInfo>`: `None` for a request the layer let through without a key.
    impl<S: Send + Sync> OptionalFromRequestParts<S> for LockInfo {
        type Rejection = Infallible;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Infallible> {
            Ok(parts.extensions.get::<LockInfo>().cloned())
        }
    }
}

/// What a distributed backend adds to a `LockInfo`.
#[derive(Clone)]
struct Remote {
    fencing_token: Option<u64>,
    lease: Option<LeaseSignal>,
}

/// Which layer value holds a key, as `LockInfo` carries it: no reference to the layer's
/// state, so a request need not count one (nor a handler that keeps its `LockInfo` keep
/// the table alive).
#[derive(Clone)]
pub(crate) struct LayerTag {
    /// Unique per layer value for the life of the process (not an address, which a
    /// later layer could reuse).
    id: u64,
    name: LayerName,
}

/// A layer's name: a `&'static str` is copied, any other shared.
#[derive(Clone)]
pub(crate) enum LayerName {
    Static(&'static str),
    Shared(Arc<str>),
}

impl LayerName {
    pub(crate) fn as_str(&self) -> &str {
        match self {
            LayerName::Static(name) => name,
            LayerName::Shared(name) => name,
        }
    }
}

impl LayerTag {
    /// The layer's name.
    pub(crate) fn name(&self) -> &LayerName {
        &self.name
    }

    pub(crate) fn new(name: Cow<'static, str>) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name: match name {
                Cow::Borrowed(name) => LayerName::Static(name),
                Cow::Owned(name) => LayerName::Shared(Arc::from(name)),
            },
        }
    }
}

impl fmt::Debug for LockInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockInfo")
            .field("layer", &self.layer())
            .field("key", &self.key)
            .field("waited", &self.waited)
            .field("fencing_token", &self.fencing_token())
            .field("lease", &self.lease())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::{LayerName, LayerTag};

    #[test]
    fn a_layer_tag_names_its_layer_and_is_unique_per_layer_value() {
        let fixed = LayerTag::new(Cow::Borrowed("orders"));
        let built = LayerTag::new(Cow::Owned(format!("{}-orders", "acme")));
        let again = LayerTag::new(Cow::Borrowed("orders"));
        assert!(matches!(fixed.name, LayerName::Static("orders")));
        assert!(matches!(&built.name, LayerName::Shared(name) if &**name == "acme-orders"));
        // Two layers with one name are still two tables.
        assert_ne!(fixed.id, again.id);
        assert_eq!(fixed.clone().id, fixed.id);
    }
}

#[cfg(all(test, feature = "axum"))]
mod extractor_tests {
    use axum::body::Body;
    use axum::routing::post;
    use axum::Router;
    use http::{Request, StatusCode};
    use tower::ServiceExt;

    use super::LockInfo;
    use crate::KeyedLockLayer;

    async fn post_to(app: Router, uri: &str) -> (StatusCode, String) {
        let request = Request::post(uri).body(Body::empty()).unwrap();
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .unwrap();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_handler_behind_the_layer_takes_lock_info() {
        let app = Router::new()
            .route(
                "/orders/{id}",
                post(|lock: LockInfo| async move { lock.key().to_owned() }),
            )
            .layer(KeyedLockLayer::by_path("id"));
        assert_eq!(
            post_to(app, "/orders/7").await,
            (StatusCode::OK, "7".into())
        );
    }

    #[tokio::test]
    async fn a_route_not_behind_the_layer_is_a_500_problem() {
        let app = Router::new().route("/orders", post(|_: LockInfo| async {}));
        let (status, body) = post_to(app, "/orders").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(body.contains(r#""reason":"misconfigured""#), "{body}");
    }

    #[tokio::test]
    async fn optional_lock_info_is_none_for_a_request_let_through() {
        let app = Router::new()
            .route(
                "/deliveries",
                post(|lock: Option<LockInfo>| async move { format!("{}", lock.is_some()) }),
            )
            .layer(KeyedLockLayer::by_header("idempotency-key").allow_missing_key());
        assert_eq!(
            post_to(app, "/deliveries").await,
            (StatusCode::OK, "false".into())
        );
    }
}
