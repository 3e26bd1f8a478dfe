//! [`KeyedLockLayer`]: per-key request serialization as a tower layer.
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use http::StatusCode;
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! async fn pay() -> &'static str { "paid" }
//! async fn refund() -> &'static str { "refunded" }
//!
//! let app: Router = Router::new()
//!     .route("/orders/{order_id}/pay", post(pay))
//!     .route("/orders/{order_id}/refund", post(refund))
//!     // `route_layer`: path parameters exist on routes, not on the fallback.
//!     .route_layer(
//!         KeyedLockLayer::by_path("order_id")
//!             .wait_timeout(Duration::from_secs(2)) // then 409 Conflict…
//!             .timeout_status(StatusCode::CONFLICT) // …or 429
//!             .max_waiters(32),                     // queue bound per key, then 429
//!     );
//! ```
//!
//! # With authentication: which layer goes first
//!
//! A lock keyed by the user needs the user id that an authentication layer puts in the
//! request extensions, so the authentication layer must run *before* (outside) the lock.
//! With `Router::layer`, the layer added *last* runs *first*; with tower's
//! `ServiceBuilder`, the layer added *first* runs first.
//!
//! ```
//! use std::time::Duration;
//! use axum::extract::Request;
//! use axum::middleware::{self, Next};
//! use axum::response::{IntoResponse, Response};
//! use axum::{routing::post, Extension, Router};
//! use http::StatusCode;
//! use tower::ServiceBuilder;
//! use tower_keyed_lock::{KeyedLockLayer, LockInfo};
//!
//! #[derive(Clone)]
//! struct UserId(u64);
//!
//! impl std::fmt::Display for UserId {
//!     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
//!         write!(f, "user-{}", self.0)
//!     }
//! }
//!
//! /// Authentication: a bearer token becomes a `UserId` in the extensions.
//! async fn authenticate(mut request: Request, next: Next) -> Response {
//!     let token = request.headers().get("authorization").and_then(|v| v.to_str().ok());
//!     let Some(id) = token.and_then(|t| t.strip_prefix("Bearer user-")?.parse().ok()) else {
//!         return StatusCode::UNAUTHORIZED.into_response();
//!     };
//!     request.extensions_mut().insert(UserId(id));
//!     next.run(request).await
//! }
//!
//! async fn transfer(Extension(lock): Extension<LockInfo>) -> String {
//!     format!("transfer for {} ran alone", lock.key())
//! }
//!
//! let per_user = KeyedLockLayer::by_extension::<UserId>()
//!     .name("transfers")
//!     .wait_timeout(Duration::from_secs(1))
//!     .timeout_status(StatusCode::TOO_MANY_REQUESTS);
//!
//! // `Router::layer`: the last layer added runs first, so authentication goes last.
//! let app: Router = Router::new()
//!     .route("/transfers", post(transfer))
//!     .layer(per_user.clone())
//!     .layer(middleware::from_fn(authenticate));
//!
//! // `ServiceBuilder`: top to bottom is outside to inside, so authentication goes first.
//! let same_app: Router = Router::new().route("/transfers", post(transfer)).layer(
//!     ServiceBuilder::new()
//!         .layer(middleware::from_fn(authenticate))
//!         .layer(per_user),
//! );
//! # let _ = (app, same_app);
//! ```
//!
//! If the lock runs first by mistake, no `UserId` is there yet: every request gets a
//! 500 and the layer logs the missing extension once, naming its type.
//!
//! # On a single route
//!
//! `post(handler).layer(lock)` works. Chaining a second `.layer` on a `MethodRouter`
//! fails with E0283 ("cannot infer type of the type parameter `NewError`"): the error
//! type between the two layers is left open. Name it on the first call, or use
//! `Router::route_layer` instead:
//!
//! ```
//! use std::convert::Infallible;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! let route = post(|| async { "paid" })
//!     .layer::<_, Infallible>(KeyedLockLayer::by_path("order_id"))
//!     .layer(KeyedLockLayer::by_header("x-user"));
//! let app: Router = Router::new().route("/orders/{order_id}/pay", route);
//! ```
//!
//! # Use outside axum
//!
//! The layer works for any tower service over `http::Request`/`http::Response` whose
//! response body yields [`Bytes`](bytes::Bytes): hyper services, tonic servers
//! (`tonic::transport::Server::builder().layer(KeyedLockLayer::by_header(..))`, keyed by
//! a metadata header, since gRPC has no path parameters) or a bare `service_fn`.
//!
//! # Files
//!
//! - `builder.rs`: [`KeyedLockLayer`], its settings and their defaults.
//! - `shared.rs`: the state every service of one layer value shares (table, settings,
//!   metric handles); every other file here reads it.
//! - `names.rs`: the names layers hold on their backends: two layers under one name on
//!   one backend are refused.
//! - `service.rs`: [`KeyedLock`], which takes the key from the request and starts the wait.
//! - `look_first.rs`: the hook a layer stacked inside (replay) looks through before the
//!   key is taken.
//! - `future.rs`: [`ResponseFuture`], which waits for the key, readies the inner service
//!   and runs it under the key.
//! - `held.rs`: a request's hold on its key, released on drop.
//! - `body.rs`: [`KeyedLockBody`], the inner body (carrying the hold, if the key is held
//!   until the body ends) or the layer's own rejection body.
//! - `info.rs`: [`LockInfo`], what the handler learns about its lock.
//! - `health.rs`: [`HealthCheck`], the backend's health check for a readiness route.
//! - `shutdown.rs`: [`ShutdownHandle`], the layer's graceful shutdown.

mod body;
mod builder;
mod future;
mod health;
mod held;
mod info;
mod look_first;
mod names;
mod rejected;
mod service;
pub(crate) mod shared;
mod shutdown;
mod trace;

pub use body::KeyedLockBody;
pub use builder::{
    KeyedLockLayer, DEFAULT_MAX_WAITERS, DEFAULT_NAME, DEFAULT_RETRY_AFTER, DEFAULT_WAIT_TIMEOUT,
};
pub use future::ResponseFuture;
pub use health::HealthCheck;
// For the replay module, which looks through the hook.
#[cfg(feature = "replay")]
pub(crate) use info::LayerName;
pub use info::LockInfo;
#[cfg(feature = "replay")]
pub(crate) use info::PassedWithoutKey;
#[cfg(feature = "replay")]
pub(crate) use look_first::LookFirst;
pub use service::KeyedLock;
pub use shutdown::ShutdownHandle;
