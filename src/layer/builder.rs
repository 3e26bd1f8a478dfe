//! [`KeyedLockLayer`]: the builder, its settings and their defaults.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Response, StatusCode};
use tower_layer::Layer;

use super::service::KeyedLock;
use super::shared::{Config, Shared};
use crate::backend::LockBackend;
use crate::distributed::{DistributedLocks, DistributedLocksBuilder};
use crate::key::{ExtensionKey, FnKey, HeaderKey, KeyExtractor};
use crate::reject::Rejection;

/// The default [`KeyedLockLayer::wait_timeout`].
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default [`KeyedLockLayer::retry_after`].
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// The default [`KeyedLockLayer::max_waiters`]: enough for a burst on one key, while
/// bounding what a flood of requests for one key can queue.
pub const DEFAULT_MAX_WAITERS: usize = 1024;
/// The default [`KeyedLockLayer::name`].
pub const DEFAULT_NAME: &str = "default";

/// Serializes requests that carry the same key; requests with different keys run in
/// parallel. See the [module docs](crate::layer) for an example.
///
/// The guard is taken before the inner service is called and held until the inner
/// future completes (or, with [`hold_until_body_end`](Self::hold_until_body_end), until
/// the response body ends). The handler finds a [`LockInfo`](crate::LockInfo) in the
/// request extensions. Rejections are ordinary responses (`Ok`), so axum needs no
/// `HandleErrorLayer`:
///
/// | case | status | `Retry-After` |
/// |---|---|---|
/// | wait timeout | [`timeout_status`](Self::timeout_status) (409) | yes |
/// | queue full ([`max_waiters`](Self::max_waiters)) | 429 | yes |
/// | table full ([`max_keys`](Self::max_keys)) | 503 | yes |
/// | key header missing, repeated, empty, not UTF-8, control characters, too long | 400 | no |
/// | path parameter or extension the server should have put there missing (misconfiguration, logged once at `error`) | 500 | no |
/// | backend unreachable ([`backend`](Self::backend), unless [`fail_open`](Self::fail_open)) | 503 | yes |
/// | lease lost while the handler ran, with [`abort_on_lease_lost`](Self::abort_on_lease_lost) | 503 | yes |
/// | body too large, not read in time or broken, with [`BufferRequestBodyLayer`](crate::BufferRequestBodyLayer) | 413 / 408 / 400 | no |
///
/// Bodies are `application/problem+json` (RFC 9457); [`on_rejection`](Self::on_rejection)
/// replaces them.
///
/// Configuration is fixed before the layer is applied. Every clone of a configured layer,
/// and every route it is applied to, shares one lock table; a builder method called
/// after it was applied makes a new layer value with a table of its own. A builder
/// method called after a [`shutdown_handle`](Self::shutdown_handle) or a
/// [`health_check`](Self::health_check) was taken panics instead: the handle would not
/// see the layer it makes.
///
/// With a [`backend`](Self::backend), two layers under one [`name`](Self::name) on one
/// backend are refused when the second is applied: in process two layers never exclude
/// each other, so they must not through the backend either. Give each its own name.
#[derive(Clone)]
#[must_use]
pub struct KeyedLockLayer<E> {
    extractor: E,
    /// The lock's settings: name, permits, limits, backend.
    locks: DistributedLocksBuilder,
    /// The layer's own settings.
    config: Config,
    /// The table and settings, made once when the layer is first applied.
    table: Arc<Table>,
}

/// A configured layer value's table, made when it is first applied or a handle is
/// taken; shared by its clones.
#[derive(Default)]
struct Table {
    shared: OnceLock<Arc<Shared>>,
    /// Whether a shutdown handle or health check was taken: then no setting may change.
    handed_out: AtomicBool,
}

#[cfg(feature = "axum")]
impl KeyedLockLayer<crate::key::PathParam> {
    /// Keys requests by the axum path parameter `name` (as in `/orders/{order_id}`).
    ///
    /// Prefer `Router::route_layer`: it wraps only the routes, which is where path
    /// parameters exist. `Router::layer` works too: it also wraps the fallback, and a
    /// request that matched no route passes through untouched, so its 404 (or your
    /// custom fallback) still reaches the client. A matched route without the parameter
    /// is a server misconfiguration: 500 and one `error` log per layer.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let app: Router = Router::new()
    ///     .route("/orders/{order_id}/pay", post(|| async { "paid" }))
    ///     .route_layer(KeyedLockLayer::by_path("order_id"));
    /// ```
    pub fn by_path(name: &str) -> Self {
        Self::new(crate::key::PathParam::new(name))
    }
}

impl KeyedLockLayer<HeaderKey> {
    /// Keys requests by the value of the header `name`, such as `idempotency-key`.
    /// The client controls it: a request without it, with an unusable value, or with
    /// the header more than once (which value would the application read?) gets 400.
    ///
    /// `name` is a [`HeaderName`] or anything that converts into one (a `&str`,
    /// a `String`).
    ///
    /// # Panics
    /// If `name` is not a valid header name (a configuration mistake, found when the
    /// layer is built, like `HeaderName::from_static`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_keyed_lock::http::HeaderName;
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// // A duplicate webhook delivery in flight gets 409 at once.
    /// let layer = KeyedLockLayer::by_header("idempotency-key").wait_timeout(Duration::ZERO);
    /// // GitHub names each delivery in a header of its own.
    /// let github = KeyedLockLayer::by_header(HeaderName::from_static("x-github-delivery"));
    /// ```
    pub fn by_header<N>(name: N) -> Self
    where
        N: TryInto<HeaderName> + fmt::Debug + Clone,
    {
        let header = name
            .clone()
            .try_into()
            .unwrap_or_else(|_| panic!("by_header: {name:?} is not a valid header name"));
        Self::new(HeaderKey::new(header))
    }
}

// Written for `ExtensionKey<()>` only so that `KeyedLockLayer::by_extension::<T>()`
// names `T` on the function, where callers expect it.
impl KeyedLockLayer<ExtensionKey<()>> {
    /// Keys requests by a value of type `T` that an earlier layer (usually
    /// authentication) put in the request extensions, such as a user id; the key is
    /// its `Display` text.
    ///
    /// ```
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// #[derive(Clone)]
    /// struct UserId(u64);
    /// impl std::fmt::Display for UserId {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    ///         write!(f, "user-{}", self.0)
    ///     }
    /// }
    ///
    /// // Add it inside (before) the auth layer that inserts the `UserId`.
    /// let layer = KeyedLockLayer::by_extension::<UserId>();
    /// ```
    pub fn by_extension<T: fmt::Display + Send + Sync + 'static>() -> KeyedLockLayer<ExtensionKey<T>>
    {
        KeyedLockLayer::new(ExtensionKey::new())
    }
}

#[cfg(feature = "json")]
impl KeyedLockLayer<crate::key::JsonBodyKey> {
    /// Keys requests by the value at a JSON pointer (RFC 6901) in the JSON request
    /// body, such as Stripe's event id at `/id`: a string is the key, an integer its
    /// decimal text; anything else, a missing field or a body that is not JSON gets 400
    /// problem+json, like a bad header key. See [`JsonBodyKey`](crate::JsonBodyKey).
    ///
    /// The body must be read first, by a [`BufferRequestBodyLayer`](crate::BufferRequestBodyLayer)
    /// outside this layer; without one every request gets 500 and an `error` is logged
    /// once (the server is set up wrong). The handler still gets the whole body.
    ///
    /// # Panics
    /// If `pointer` is not a JSON pointer (it must be empty or start with `/`).
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_keyed_lock::{BufferRequestBodyLayer, KeyedLockLayer};
    ///
    /// let app: Router = Router::new()
    ///     .route("/webhooks/stripe", post(|body: String| async move { body }))
    ///     .layer(KeyedLockLayer::by_json_body("/id"))
    ///     // Added last, so it runs first: the body is read before the key is taken.
    ///     .layer(BufferRequestBodyLayer::new());
    /// ```
    pub fn by_json_body(pointer: &str) -> Self {
        Self::new(crate::key::JsonBodyKey::new(pointer))
    }
}

impl<F> KeyedLockLayer<FnKey<F>>
where
    F: Fn(&http::request::Parts) -> Option<String> + Clone + Send + Sync + 'static,
{
    /// Keys requests by a function of the request head; `None` means "no key".
    ///
    /// ```
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// // Serialize per tenant, taken from the host name.
    /// let layer = KeyedLockLayer::by_fn(|parts| {
    ///     let host = parts.headers.get(http::header::HOST)?.to_str().ok()?;
    ///     Some(host.split('.').next()?.to_owned())
    /// });
    /// ```
    pub fn by_fn(f: F) -> Self {
        Self::new(FnKey::new(f))
    }
}

impl<E: KeyExtractor> KeyedLockLayer<E> {
    /// Keys requests with a custom [`KeyExtractor`].
    ///
    /// ```
    /// use std::borrow::Cow;
    /// use tower_keyed_lock::{KeyError, KeyExtractor, KeyedLockLayer};
    ///
    /// /// The account in the first path segment: `/acct-1/...`.
    /// #[derive(Clone)]
    /// struct Account;
    ///
    /// impl KeyExtractor for Account {
    ///     fn extract<'a>(
    ///         &self,
    ///         parts: &'a mut http::request::Parts,
    ///     ) -> Result<Cow<'a, str>, KeyError> {
    ///         let segment = parts.uri.path().trim_start_matches('/').split('/').next();
    ///         let segment = segment.filter(|s| !s.is_empty()).ok_or(KeyError::Missing)?;
    ///         Ok(Cow::Owned(segment.to_owned()))
    ///     }
    /// }
    ///
    /// let layer = KeyedLockLayer::new(Account);
    /// ```
    pub fn new(extractor: E) -> Self {
        Self {
            extractor,
            // The lock's defaults (one permit, no key bound, keys up to
            // `DEFAULT_MAX_KEY_LEN`, no backend, fail closed) but a bounded queue.
            locks: DistributedLocks::builder(DEFAULT_NAME).max_waiters(DEFAULT_MAX_WAITERS),
            config: Config {
                wait_timeout: DEFAULT_WAIT_TIMEOUT,
                timeout_status: StatusCode::CONFLICT,
                retry_after: DEFAULT_RETRY_AFTER,
                allow_missing_key: false,
                hold_until_body_end: false,
                long_hold: None,
                on_rejection: None,
                abort_on_lease_lost: false,
                shared_methods: Box::new([]),
                trace_keys: false,
            },
            table: Arc::default(),
        }
    }

    /// Changes the layer's own settings; the result is a new layer value with its own
    /// table.
    #[track_caller]
    fn configure(mut self, change: impl FnOnce(&mut Config)) -> Self {
        self.detach();
        change(&mut self.config);
        self
    }

    /// Changes the lock's settings; the result is a new layer value with its own table.
    #[track_caller]
    fn configure_locks(
        mut self,
        change: impl FnOnce(DistributedLocksBuilder) -> DistributedLocksBuilder,
    ) -> Self {
        self.detach();
        self.locks = change(self.locks);
        self
    }

    /// Gives this value a table of its own, before a setting changes.
    ///
    /// # Panics
    /// If a shutdown handle or health check was taken from it (or a clone): the handle
    /// would keep working on the old table and silently miss the new layer.
    #[track_caller]
    fn detach(&mut self) {
        assert!(
            !self.table.handed_out.load(Ordering::Acquire),
            "KeyedLockLayer: a setting was changed after `shutdown_handle()` or \
             `health_check()` was taken; the handle would shut down and check the layer \
             it was taken from, not this new one. Take handles after the last setting"
        );
        self.table = Arc::default();
    }

    /// How long a request waits for its key before it is rejected with
    /// [`timeout_status`](Self::timeout_status). Default [`DEFAULT_WAIT_TIMEOUT`] (5 s).
    /// `Duration::ZERO` tries once and never waits: "a request for this key is already
    /// in progress".
    #[track_caller]
    pub fn wait_timeout(self, timeout: Duration) -> Self {
        self.configure(|c| c.wait_timeout = timeout)
    }

    /// The status of a wait timeout: 409 Conflict (default, "a request for this key is
    /// already in progress") or 429 Too Many Requests; any 4xx or 5xx is accepted.
    ///
    /// # Panics
    /// If `status` is not a client or server error (a 2xx "rejection" would tell the
    /// client its request ran).
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let layer = KeyedLockLayer::by_header("x-user").timeout_status(StatusCode::TOO_MANY_REQUESTS);
    /// ```
    #[track_caller]
    pub fn timeout_status(self, status: StatusCode) -> Self {
        assert!(
            status.is_client_error() || status.is_server_error(),
            "KeyedLockLayer::timeout_status must be a 4xx or 5xx status, not {status}"
        );
        self.configure(|c| c.timeout_status = status)
    }

    /// The `Retry-After` of timeout, queue-full and table-full rejections
    /// (default 1 s, rounded up to whole seconds).
    #[track_caller]
    pub fn retry_after(self, after: Duration) -> Self {
        self.configure(|c| c.retry_after = after)
    }

    /// Requests allowed to wait per key (default [`DEFAULT_MAX_WAITERS`], 1024); one
    /// beyond it gets 429 at once. `usize::MAX` lets the queue grow without bound.
    #[track_caller]
    pub fn max_waiters(self, max_waiters: usize) -> Self {
        self.configure_locks(|locks| locks.max_waiters(max_waiters))
    }

    /// Keys with a holder or waiter allowed at once (default unbounded); a request for
    /// a new key beyond it gets 503. Set it when keys come from clients.
    ///
    /// ```
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// // Keys from a client header: bound their length and their number.
    /// let layer = KeyedLockLayer::by_header("idempotency-key")
    ///     .max_key_len(64)
    ///     .max_keys(100_000);
    /// ```
    #[track_caller]
    pub fn max_keys(self, max_keys: usize) -> Self {
        self.configure_locks(|locks| locks.max_keys(max_keys))
    }

    /// Requests with one of `methods` take their key shared: they run together with
    /// each other, and never beside a request that takes it exclusively (every other
    /// method). Waiters are served in arrival order whatever their method, so a waiting
    /// `PUT` stops new `GET`s from entering until it has run. [`LockInfo::is_shared`](crate::LockInfo::is_shared)
    /// tells the handler which.
    ///
    /// ```
    /// use axum::{routing::get, Router};
    /// use http::Method;
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let app: Router = Router::new()
    ///     .route("/orders/{order_id}", get(|| async { "order" }).put(|| async { "updated" }))
    ///     // GETs of one order run in parallel; a PUT runs alone.
    ///     .layer(KeyedLockLayer::by_path("order_id").shared_methods([Method::GET, Method::HEAD]));
    /// ```
    ///
    /// With a distributed [`backend`](Self::backend) that holds keys shared (Redis,
    /// PostgreSQL with session locks), the GETs of every instance hold a key together
    /// and a PUT of any instance runs alone; a waiting PUT stops new GETs everywhere.
    ///
    /// # Panics
    /// When the layer is applied with a backend that cannot hold a key shared
    /// ([`LockBackend::supports`](crate::LockBackend::supports)), naming it: such
    /// requests must not run exclusively or under this process's lock only instead.
    #[track_caller]
    pub fn shared_methods(self, methods: impl IntoIterator<Item = http::Method>) -> Self {
        let methods: Box<[http::Method]> = methods.into_iter().collect();
        self.configure(|c| c.shared_methods = methods)
    }

    /// Whether the layer's `tracing` spans carry the key (off by default).
    ///
    /// The layer opens a DEBUG span `keyed_lock.wait` while a request waits for its key
    /// (field `outcome`: `acquired`, `timeout`, `queue_full`, `backend`, `cancelled`,
    /// …) and `keyed_lock.hold` while it runs under it (fields `shared`,
    /// `fencing_token`); the handler's spans nest in the hold. Both carry the layer's
    /// `name` and the `route` template, never the key, which comes from the client —
    /// unless this is on: then a `key` field with its first 16 characters, escaped.
    /// A subscriber that does not enable them costs next to nothing (BENCHMARKS.md).
    #[track_caller]
    pub fn trace_keys(self, on: bool) -> Self {
        self.configure(|c| c.trace_keys = on)
    }

    /// Requests allowed to hold one key at once (default 1): with a distributed
    /// [`backend`](Self::backend), across every instance (each holder with a lease of
    /// its own; see [`DistributedLocksBuilder::permits`](crate::DistributedLocksBuilder::permits)).
    ///
    /// # Panics
    /// If `permits` is 0; and when the layer is applied, if it is more than 1 and the
    /// backend cannot count permits (only Redis and PostgreSQL with session locks can).
    #[track_caller]
    pub fn permits(self, permits: usize) -> Self {
        self.configure_locks(|locks| locks.permits(permits))
    }

    /// The longest key accepted, in bytes (default [`DEFAULT_MAX_KEY_LEN`](crate::DEFAULT_MAX_KEY_LEN), 256);
    /// longer keys get 400.
    #[track_caller]
    pub fn max_key_len(self, max_len: usize) -> Self {
        self.configure_locks(|locks| locks.max_key_len(max_len))
    }

    /// The `name` label of this layer's metrics (default `"default"`), and the
    /// namespace of its keys at a distributed backend: with a [`backend`](Self::backend),
    /// one name per layer (a second layer under it on the same backend is refused when
    /// applied). A `&'static str` or a `String`.
    ///
    /// ```
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let tenant = "acme";
    /// let layer = KeyedLockLayer::by_path("order_id").name(format!("{tenant}-orders"));
    /// ```
    #[track_caller]
    pub fn name(self, name: impl Into<Cow<'static, str>>) -> Self {
        self.configure_locks(|locks| locks.rename(name.into()))
    }

    /// Lets requests whose key is *absent* run without a lock instead of being
    /// rejected: a missing header (400 otherwise), and also a path parameter the route
    /// does not have or an extension no layer inserted (500 otherwise), for routers
    /// where only some requests carry a key. A key that is present but unusable (empty,
    /// too long, not UTF-8, repeated) is still rejected: the client sent something
    /// broken.
    ///
    /// Such a request reaches the handler without a [`LockInfo`](crate::LockInfo), so
    /// the handler takes `Option<Extension<LockInfo>>`.
    ///
    /// ```
    /// use axum::{routing::post, Extension, Router};
    /// use tower_keyed_lock::{KeyedLockLayer, LockInfo};
    ///
    /// async fn deliver(lock: Option<Extension<LockInfo>>) -> &'static str {
    ///     match lock {
    ///         Some(_) => "processed under the idempotency key",
    ///         None => "processed without a key",
    ///     }
    /// }
    ///
    /// // The idempotency key is optional: requests without one are not serialized.
    /// let app: Router = Router::new()
    ///     .route("/deliveries", post(deliver))
    ///     .layer(KeyedLockLayer::by_header("idempotency-key").allow_missing_key());
    /// ```
    #[track_caller]
    pub fn allow_missing_key(self) -> Self {
        self.configure(|c| c.allow_missing_key = true)
    }

    /// Holds the key until the response body has been sent in full or dropped, not
    /// only until the handler returns (for streamed responses whose writing is part of
    /// the critical section).
    ///
    /// ```
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// // An export streamed to the client is part of the critical section.
    /// let layer = KeyedLockLayer::by_path("report_id").hold_until_body_end(true);
    /// ```
    #[track_caller]
    pub fn hold_until_body_end(self, enabled: bool) -> Self {
        self.configure(|c| c.hold_until_body_end = enabled)
    }

    /// Logs one `tracing` warning (layer name, hold time so far, a short escaped key
    /// prefix) for each hold that lasts longer than `threshold`. Off by default.
    ///
    /// The check runs whenever the held request makes progress and when it releases the
    /// key, so a hold is reported at the latest when it ends; no timer is set per request.
    #[track_caller]
    pub fn warn_long_hold(self, threshold: Duration) -> Self {
        self.configure(|c| c.long_hold = Some(threshold))
    }

    /// Replaces the response of every rejection.
    ///
    /// The handler returns any `http::Response` whose body yields [`Bytes`](bytes::Bytes)
    /// — an axum response (`.into_response()`), `Response<String>`, `Response<Full<Bytes>>`.
    /// Its body is read to the end before the response is sent (a rejection's body is
    /// small; trailers are dropped); a body that fails is logged and replaced by
    /// [`Rejection::into_response`].
    ///
    /// ```
    /// use axum::response::IntoResponse;
    /// use tower_keyed_lock::{KeyedLockLayer, RejectionKind};
    ///
    /// let layer = KeyedLockLayer::by_header("idempotency-key").on_rejection(|rejection| {
    ///     let message = match rejection.kind() {
    ///         RejectionKind::Timeout => "already processing this delivery",
    ///         _ => "cannot take this request now",
    ///     };
    ///     (rejection.status(), [("x-rejected", rejection.kind().as_str())], message).into_response()
    /// });
    /// ```
    #[track_caller]
    pub fn on_rejection<F, B>(self, handler: F) -> Self
    where
        F: Fn(Rejection) -> Response<B> + Send + Sync + 'static,
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let handler = super::rejected::erase(handler);
        self.configure(|c| c.on_rejection = Some(handler))
    }

    /// Serializes keys across every instance that shares `backend` (Redis,
    /// PostgreSQL, or your own [`LockBackend`]), on top of the in-process lock: requests
    /// queue locally first and only the local winner contends remotely. The remote key
    /// is namespaced by [`name`](Self::name): a layer meets the layers of the same name
    /// on other instances, never another layer of its own instance. So give each layer
    /// its own name: two layers under one name on one backend (clones of a backend
    /// included; see [`LockBackend::identity`]) are refused with a panic when the second
    /// is applied, since in process they would not exclude each other. One layer value
    /// applied to several routes is one layer.
    ///
    /// The [`wait_timeout`](Self::wait_timeout) covers both tiers. When the backend
    /// cannot be reached the request gets 503 with `Retry-After` (fail closed) unless
    /// [`fail_open`](Self::fail_open) is set.
    #[track_caller]
    pub fn backend(self, backend: impl LockBackend) -> Self {
        self.configure_locks(|locks| locks.backend(backend))
    }

    /// When the backend fails, run the request under the in-process lock only (counted
    /// as `keyed_lock_rejected_total{reason="backend"}` and logged) instead of
    /// answering 503 (`false`, the default).
    #[track_caller]
    pub fn fail_open(self, fail_open: bool) -> Self {
        self.configure_locks(|locks| locks.fail_open(fail_open))
    }

    /// When a request's distributed lease is lost while it runs, drop the inner future
    /// and answer 503, instead of only raising [`LockInfo::is_lease_lost`](crate::LockInfo::is_lease_lost)
    /// (`false`, the default).
    #[track_caller]
    pub fn abort_on_lease_lost(self, abort: bool) -> Self {
        self.configure(|c| c.abort_on_lease_lost = abort)
    }

    /// A handle that shuts this layer's lock table down gracefully (see
    /// [`ShutdownHandle`](crate::layer::ShutdownHandle)), kept before `Router::layer`
    /// consumes the layer. It fixes the configuration, as applying the layer does: call
    /// it after the last setting (a setting changed afterwards panics, rather than
    /// leave the handle on a table no route uses).
    ///
    /// ```
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let layer = KeyedLockLayer::by_header("idempotency-key");
    /// let shutdown = layer.shutdown_handle();
    /// assert!(!shutdown.is_shutting_down());
    /// ```
    pub fn shutdown_handle(&self) -> super::ShutdownHandle {
        super::ShutdownHandle::new(self.handed_out().locks.clone())
    }

    /// Keys with a holder or a waiter now, in this layer's table.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let layer = KeyedLockLayer::by_path("order_id");
    /// let app: Router = Router::new()
    ///     .route("/orders/{order_id}", post(|| async {}))
    ///     .layer(layer.clone()); // the clone shares the table
    /// assert_eq!(layer.active_keys(), 0);
    /// ```
    pub fn active_keys(&self) -> usize {
        (self.table.shared.get()).map_or(0, |shared| shared.locks.len())
    }

    /// A handle on the layer's health check (see [`Health`](crate::backend::Health)),
    /// for a readiness probe or a health route; take it before the layer is applied,
    /// after the last setting (it fixes the configuration, as
    /// [`shutdown_handle`](Self::shutdown_handle) does). It checks the backend, reports
    /// the last backend error the layer's requests met, and turns unhealthy (503) as
    /// soon as the layer's shutdown begins.
    ///
    /// ```
    /// use axum::{routing::{get, post}, Router};
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let orders = KeyedLockLayer::by_path("order_id"); // add `.backend(…)` to check it
    /// let health = orders.health_check();
    /// let app: Router = Router::new()
    ///     .route("/orders/{order_id}", post(|| async { "paid" }))
    ///     .route_layer(orders)
    ///     .route("/ready", get(move || async move { health.check().await }));
    /// ```
    pub fn health_check(&self) -> crate::HealthCheck {
        crate::HealthCheck::new(self.handed_out().locks.clone())
    }

    /// The distributed backend configured, if any.
    #[cfg(feature = "replay")]
    pub(crate) fn backend_handle(&self) -> Option<Arc<dyn crate::LockBackend>> {
        self.locks.backend_handle()
    }

    /// The lock around `inner`, looking for each request's replay record before it
    /// takes the key (see [`KeyedLockLayer::replay`]); on this layer value's table.
    #[cfg(feature = "replay")]
    pub(crate) fn layer_looking_first<S>(
        &self,
        inner: S,
        look: Arc<dyn super::LookFirst>,
    ) -> KeyedLock<S, E> {
        KeyedLock::new(inner, self.extractor.clone(), self.shared()).looking_first(look)
    }

    fn shared(&self) -> Arc<Shared> {
        (self.table.shared)
            .get_or_init(|| Arc::new(Shared::new(self.locks.clone(), self.config.clone())))
            .clone()
    }

    /// The table, for a handle that must see it whatever comes later: no setting may
    /// change from now on.
    fn handed_out(&self) -> Arc<Shared> {
        let shared = self.shared();
        self.table.handed_out.store(true, Ordering::Release);
        shared
    }
}

impl<S, E: KeyExtractor> Layer<S> for KeyedLockLayer<E> {
    type Service = KeyedLock<S, E>;

    fn layer(&self, inner: S) -> Self::Service {
        KeyedLock::new(inner, self.extractor.clone(), self.shared())
    }
}

impl<E: fmt::Debug> fmt::Debug for KeyedLockLayer<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("KeyedLockLayer")
            .field("extractor", &self.extractor)
            .field("locks", &self.locks)
            .field("wait_timeout", &c.wait_timeout)
            .field("timeout_status", &c.timeout_status)
            .field("allow_missing_key", &c.allow_missing_key)
            .field("hold_until_body_end", &c.hold_until_body_end)
            .field("long_hold", &c.long_hold)
            .field("abort_on_lease_lost", &c.abort_on_lease_lost)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "permits must be at least 1")]
    fn zero_permits_are_refused() {
        let _ = KeyedLockLayer::by_header("x-key").permits(0);
    }

    #[test]
    #[should_panic(expected = "must be a 4xx or 5xx status")]
    fn a_success_status_is_refused_as_the_timeout_status() {
        let _ = KeyedLockLayer::by_header("x-key").timeout_status(StatusCode::OK);
    }

    #[test]
    fn any_error_status_is_accepted_and_name_takes_a_string() {
        let layer = KeyedLockLayer::by_header("x-key")
            .timeout_status(StatusCode::SERVICE_UNAVAILABLE)
            .name(String::from("tenant-a"));
        assert_eq!(layer.config.timeout_status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(layer.locks.name(), "tenant-a");
        let debug = format!("{layer:?}");
        assert!(debug.contains("max_waiters: 1024"), "{debug}");
    }
}
