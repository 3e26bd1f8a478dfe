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
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::{KeyedLockLayer, LockInfo};
//!
//! async fn pay(lock: LockInfo) -> String {
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
//! # #[cfg(feature = "postgres")]
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_keyed_lock::{DistributedLocks, LockError, PostgresBackend};
//! # async fn send_invoices() {}
//!
//! let backend = PostgresBackend::builder_from_str("host=db user=app dbname=app")?
//!     .fencing(true)
//!     .build()
//!     .await?;
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
//!   renewal, fencing tokens, a release handing the key to the first queued writer and
//!   announcing it on pub/sub).
//! - `postgres`: `PostgresBackend`, the same through PostgreSQL advisory locks (waiters
//!   queue inside PostgreSQL; lost sessions are detected; optional fencing tokens).
//! - `dynamodb`: `DynamoDbBackend`, the same through conditional writes on a DynamoDB
//!   table (leases, renewal, fencing tokens, takeover timed on the local clock).
//! - `etcd`: `EtcdBackend`, the same through etcd (a lease per holder, waiters queued
//!   in arrival order across instances and woken by a watch, fencing tokens from the
//!   cluster-wide revision).
//! - `azure-blob`: `AzureBlobBackend`, the same through Azure Blob Storage blob leases
//!   (renewal, fencing tokens in blob metadata, polling waiters; needs Rust 1.88).
//! - `s3`: `S3Backend`, the same through conditional writes on Amazon S3 objects
//!   (`If-None-Match`, `If-Match`; renewal, fencing tokens, takeover timed on the local
//!   clock, polling waiters; needs Rust 1.94.1).
//! - `zookeeper`: `ZooKeeperBackend`, the same through ZooKeeper (an ephemeral
//!   sequential node per contender, waiters queued in arrival order across instances
//!   and woken by a watch on their predecessor, fencing tokens from the node's zxid).
//! - `mysql`: `MySqlBackend`, the same through MySQL / MariaDB named locks
//!   (`GET_LOCK`; waiters queue inside the server; lost sessions are detected;
//!   optional fencing tokens from a counter table).
//! - `replay`: [`replay::ReplayLayer`], replaying the stored response of a completed
//!   request to later requests with its key (in memory; in Redis or PostgreSQL with
//!   `redis` / `postgres` too).
//! - `json`: `KeyedLockLayer::by_json_body` and `JsonBodyKey`, the key from a field of
//!   the JSON request body.
//! - `testkit`: the backend conformance suite (`testkit` module), to prove a
//!   `LockBackend` of your own the way every engine here is proven.
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
// `loom` is the model checks' build, never a user's: not named in the docs.
#![cfg_attr(docsrs, doc(auto_cfg(hide(loom))))]

/// `get_ref`, `get_mut` and `into_inner` for a service that wraps its inner service
/// in a field `inner` (as tower-http's middleware have them).
macro_rules! inner_service_accessors {
    () => {
        /// The inner service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The inner service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// The inner service, consuming this one.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

pub mod backend;
mod body;
pub mod buffer;
pub mod distributed;
mod error;
mod json_text;
pub mod key;
pub mod layer;
pub mod locks;
pub mod metrics;
pub mod reject;
mod rejection_kind;
#[cfg(feature = "replay")]
pub mod replay;
mod sync;
#[cfg(all(feature = "testkit", not(loom)))]
pub mod testkit;
mod within;

/// A boxed, sendable future, as [`LockBackend`] and the replay stores return: their
/// calls are network round trips, where one allocation is noise.
pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

#[cfg(feature = "azure-blob")]
pub use backend::azure_blob::AzureBlobBackend;
#[cfg(feature = "dynamodb")]
pub use backend::dynamodb::DynamoDbBackend;
#[cfg(feature = "etcd")]
pub use backend::etcd::EtcdBackend;
#[cfg(feature = "mysql")]
pub use backend::mysql::MySqlBackend;
#[cfg(feature = "postgres")]
pub use backend::postgres::PostgresBackend;
#[cfg(feature = "redis")]
pub use backend::redis::RedisBackend;
#[cfg(feature = "redis")]
pub use backend::redlock::RedlockBackend;
#[cfg(feature = "s3")]
pub use backend::s3::S3Backend;
#[cfg(feature = "zookeeper")]
pub use backend::zookeeper::ZooKeeperBackend;
pub use backend::{Lease, LeaseSignal, LockBackend};
pub use buffer::{BufferRequestBody, BufferRequestBodyLayer, BufferedBody};
pub use distributed::{
    DistributedAcquire, DistributedGuard, DistributedGuards, DistributedLocks,
    DistributedLocksBuilder, LeaderElection, LeaderInfo, Leadership, LeaseLost, ShutdownReport,
};
pub use error::LockError;
#[cfg(feature = "json")]
pub use key::JsonBodyKey;
#[cfg(feature = "axum")]
pub use key::PathParam;
pub use key::{ExtensionKey, FnKey, HeaderKey, Key, KeyError, KeyExtractor, DEFAULT_MAX_KEY_LEN};
pub use layer::{
    HealthCheck, KeyedLock, KeyedLockBody, KeyedLockLayer, LockInfo, ResponseFuture, ShutdownHandle,
};
pub use locks::{Acquire, KeyGuard, KeyGuards, KeyedLocks, KeyedLocksBuilder};
pub use reject::{Rejection, RejectionKind};

// The crates whose types configure this one, re-exported so that the versions always
// match this crate's: `tower_keyed_lock::http::StatusCode` for `timeout_status`, the
// clients the backends are built from.
#[cfg(feature = "dynamodb")]
#[doc(no_inline)]
pub use aws_sdk_dynamodb;
#[cfg(feature = "s3")]
#[doc(no_inline)]
pub use aws_sdk_s3;
#[cfg(feature = "postgres")]
#[doc(no_inline)]
pub use deadpool_postgres;
#[doc(no_inline)]
pub use http;
#[cfg(feature = "redis")]
#[doc(no_inline)]
pub use redis;
#[cfg(feature = "postgres")]
#[doc(no_inline)]
pub use tokio_postgres;

/// The README's examples, compiled as doctests with every backend feature (they use
/// Redis, PostgreSQL, the replay layer and the JSON body key together).
#[cfg(all(
    doctest,
    feature = "redis",
    feature = "postgres",
    feature = "dynamodb",
    feature = "replay",
    feature = "json"
))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
