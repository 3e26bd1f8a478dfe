//! Per-key request serialization for tower and axum.
//!
//! Requests that carry the same key (an order id, a user id, an idempotency key) run one
//! at a time; requests with different keys run fully in parallel.
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::post, Extension, Router};
//! use tower_keyed_lock::{KeyedLockLayer, LockInfo};
//!
//! async fn pay(Extension(lock): Extension<LockInfo>) -> String {
//!     format!("order {} paid", lock.key())
//! }
//!
//! let app: Router = Router::new()
//!     .route("/orders/{order_id}/pay", post(pay))
//!     .layer(
//!         KeyedLockLayer::by_path("order_id")
//!             .wait_timeout(Duration::from_secs(2)) // then 409 Conflict (or 429)
//!             .max_waiters(32),                     // queue bound per key, then 429
//!     );
//! ```
//!
//! - [`KeyedLockLayer`] is the middleware: where keys come from, how long to wait, what
//!   to answer. See [`layer`].
//! - [`LockInfo`] is what the handler learns: the key, the time waited.
//! - [`KeyedLocks`] is the in-process keyed lock underneath, usable without HTTP.
//!   See [`locks`].
//! - [`key`] holds the key extractors, [`reject`] the rejection responses.
//!
//! # Features
//!
//! - `axum` (default): [`KeyedLockLayer::by_path`] for axum path parameters. Nothing else
//!   in the crate depends on axum.
//! - `redis`: `RedisBackend`, serializing keys across instances through Redis (leases,
//!   renewal, fencing tokens, pub/sub wake-ups).
//! - `postgres`: `PostgresBackend`, the same through PostgreSQL advisory locks (waiters
//!   queue inside PostgreSQL; lost sessions are detected; optional fencing tokens).
//!
//! # Across instances
//!
//! [`KeyedLockLayer::backend`] adds a distributed tier: requests queue in process first,
//! and only the local winner contends at the backend. See [`backend`].
#![forbid(unsafe_code)]

pub mod backend;
mod body;
mod future;
mod held;
mod info;
pub mod key;
pub mod layer;
pub mod locks;
pub mod metrics;
pub mod reject;
mod service;
mod sync;

#[cfg(feature = "postgres")]
pub use backend::postgres::PostgresBackend;
#[cfg(feature = "redis")]
pub use backend::redis::RedisBackend;
pub use backend::{Lease, LeaseSignal, LockBackend};
pub use body::KeyedLockBody;
pub use future::ResponseFuture;
pub use info::LockInfo;
#[cfg(feature = "axum")]
pub use key::PathParam;
pub use key::{ExtensionKey, FnKey, HeaderKey, Key, KeyError, KeyExtractor, DEFAULT_MAX_KEY_LEN};
pub use layer::KeyedLockLayer;
pub use locks::{Acquire, KeyGuard, KeyedLocks, KeyedLocksBuilder, LockError};
pub use reject::{Rejection, RejectionKind};
pub use service::KeyedLock;
