//! Per-key serialization for tower and axum, in one process or across instances.
//!
//! Requests that carry the same key (an order id, a user id, an idempotency key) run one
//! at a time; requests with different keys run fully in parallel. The crate has two
//! faces over one lock.
//!
//! **The middleware.** [`KeyedLockLayer`] takes the key from each request and holds it
//! while the handler runs; a wait timeout becomes 409 (or 429), every rejection a short
//! `application/problem+json` response.
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
//!     .route_layer(
//!         KeyedLockLayer::by_path("order_id")
//!             .wait_timeout(Duration::from_secs(2)) // then 409 Conflict (or 429)
//!             .max_waiters(32),                     // queue bound per key, then 429
//!     );
//! ```
//!
//! **The lock for jobs, workers and cache rebuilds.** [`DistributedLocks`] is the same
//! two-tier lock without HTTP: a scheduled job that must run on one instance of three, a
//! queue item one worker may process, a cache entry one instance rebuilds while the
//! others wait.
//!
//! ```no_run
//! use tower_keyed_lock::{DistributedLocks, LockError, PostgresBackend};
//!
//! # async fn send_invoices() {}
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = PostgresBackend::from_config_str("host=db user=app dbname=app")?.fencing(true);
//! let jobs = DistributedLocks::new("jobs", backend);
//! match jobs.try_lock("send-invoices").await {
//!     Ok(guard) => {
//!         // Dropped (cancelled) if the lease is lost to another instance.
//!         guard.run_while_held(send_invoices()).await?;
//!     }
//!     Err(LockError::Busy) => { /* another instance runs it: skip */ }
//!     Err(error) => return Err(error.into()),
//! }
//! # Ok(())
//! # }
//! ```
//!
//! - [`KeyedLockLayer`] is the middleware: where keys come from, how long to wait, what
//!   to answer. See [`layer`].
//! - [`LockInfo`] is what the handler learns: the key, the time waited, the fencing
//!   token and the lost-lease signal.
//! - [`DistributedLocks`] is the two-tier lock (this process, then a backend); see
//!   [`distributed`]. [`KeyedLocks`] is the in-process table under it; see [`locks`].
//! - [`key`] holds the key extractors, [`reject`] the rejection responses, [`metrics`]
//!   the metric names.
//!
//! # Features
//!
//! - `axum` (default): [`KeyedLockLayer::by_path`] for axum path parameters. Nothing else
//!   in the crate depends on axum.
//! - `redis`: `RedisBackend`, serializing keys across instances through Redis (leases,
//!   renewal, fencing tokens, pub/sub wake-ups).
//! - `postgres`: `PostgresBackend`, the same through PostgreSQL advisory locks (waiters
//!   queue inside PostgreSQL; lost sessions are detected; optional fencing tokens).
//! - `dynamodb`: `DynamoDbBackend`, the same through conditional writes on a DynamoDB
//!   table (leases, renewal, fencing tokens, takeover timed on the local clock).
//! - `replay`: [`replay::ReplayLayer`], replaying the stored response of a completed
//!   request to later requests with its key (in memory; in Redis or PostgreSQL with
//!   `redis` / `postgres` too).
//!
//! [`BufferRequestBodyLayer`] reads the request body before the key is taken, so a
//! client that trickles its body cannot hold the key for others.
//!
//! # Across instances
//!
//! [`KeyedLockLayer::backend`] adds a distributed tier: requests queue in process first,
//! and only the local winner contends at the backend. See [`backend`].
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
mod body;
pub mod buffer;
pub mod distributed;
mod future;
mod held;
mod info;
pub mod key;
pub mod layer;
pub mod locks;
pub mod metrics;
pub mod reject;
#[cfg(feature = "replay")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay")))]
pub mod replay;
mod service;
mod shared;
mod sync;
#[cfg(all(feature = "testkit", not(loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod testkit;

#[cfg(feature = "dynamodb")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamodb")))]
pub use backend::dynamodb::DynamoDbBackend;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use backend::mysql::MySqlBackend;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use backend::postgres::PostgresBackend;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use backend::redis::RedisBackend;
pub use backend::{Lease, LeaseSignal, LockBackend};
pub use body::KeyedLockBody;
pub use buffer::{BufferRequestBody, BufferRequestBodyLayer};
pub use distributed::{
    DistributedAcquire, DistributedGuard, DistributedLocks, DistributedLocksBuilder, LeaseLost,
};
pub use future::ResponseFuture;
pub use info::LockInfo;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use key::PathParam;
pub use key::{ExtensionKey, FnKey, HeaderKey, Key, KeyError, KeyExtractor, DEFAULT_MAX_KEY_LEN};
pub use layer::KeyedLockLayer;
pub use locks::{Acquire, KeyGuard, KeyedLocks, KeyedLocksBuilder, LockError};
pub use reject::{Rejection, RejectionKind};
pub use service::KeyedLock;
