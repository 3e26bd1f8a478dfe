//! Idempotent replay: a completed request's response is stored and replayed to later
//! requests with the same key.
//!
//! The [`KeyedLockLayer`](crate::KeyedLockLayer) makes a duplicate that arrives while
//! the first request runs wait (or get 409). [`ReplayLayer`], stacked *inside* it, makes
//! the duplicate that arrives *after* — a webhook retried for hours, an API client's
//! retry with the same `Idempotency-Key` — get the first response back instead of
//! running the handler again.
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::replay::{MemoryStore, ReplayLayer};
//! use tower_keyed_lock::{BufferRequestBodyLayer, KeyedLockLayer};
//!
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { "paid" }))
//!     // The later `.layer` is the outer one: body read, then the key, then replay.
//!     .layer(ReplayLayer::new(MemoryStore::default()))
//!     .layer(KeyedLockLayer::by_header("idempotency-key").wait_timeout(Duration::from_secs(5)))
//!     .layer(BufferRequestBodyLayer::new());
//! ```
//!
//! # What happens to a request
//!
//! Following draft-ietf-httpapi-idempotency-key-header where it speaks:
//!
//! | case | answer |
//! |---|---|
//! | first request for a key | runs under the key's lock; its response is stored |
//! | duplicate while the first runs | waits on the lock (the lock layer's `wait_timeout`), then is replayed; with `wait_timeout(ZERO)` the lock layer answers 409 |
//! | duplicate after completion, same fingerprint | the stored status, replayed headers and body, plus `Idempotent-Replayed: true`; the handler is not called |
//! | same key, different fingerprint | 422 problem+json ([`mismatch_status`](ReplayLayer::mismatch_status)), reason `fingerprint_mismatch` |
//! | handler answered 5xx, panicked, or the request was cancelled before it answered | nothing stored: a retry runs again ([`store_server_errors`](ReplayLayer::store_server_errors) stores 5xx) |
//! | 401, 403, 408, 409, 429 | never stored |
//! | response body over [`max_response_bytes`](ReplayLayer::max_response_bytes) | passed through as it streams, **not stored** |
//! | store unreachable | 503 with `Retry-After` (fail closed), or [`fail_open`](ReplayLayer::fail_open) |
//! | record older than its [`ttl`](ReplayLayer::ttl) (default 24 h) | a new request |
//! | the lock layer let the request through without a key ([`allow_missing_key`](crate::KeyedLockLayer::allow_missing_key)), or no route matched it | runs, nothing stored |
//! | no lock layer took a key first (the replay layer stacked outside the lock, or without one) | 500 problem+json, reason `misconfigured`, one `error` log per layer; the handler is not called |
//!
//! A record is scoped by the lock layer's name, the request key, the method, the matched
//! route (axum's `MatchedPath`, else the path), the request's path and query, and
//! optionally a [`principal`](ReplayLayer::principal), so one key never replays another
//! resource's (or user's) response, with the fingerprint on or off. The fingerprint is
//! SHA-256 over method, path, query and body: within one scope it tells a retry from
//! a different request (422). A sender that changes part of the body between retries
//! of one event (a delivery timestamp) gets its own comparison with
//! [`fingerprint_with`](ReplayLayer::fingerprint_with), which picks what of the body
//! counts; the scope stays the same. The Redis and PostgreSQL stores name a record by
//! the SHA-256 digest of its scope; the [`MemoryStore`] compares the scope's parts
//! themselves, and, with the built-in fingerprint, the request bodies up to 4 KiB (a
//! retry in the same scope has the same method, path and query), so a replay from
//! memory takes no digest; a longer body is compared by its digest. The same requests
//! match either way.
//!
//! Replayed headers are an allow-list ([`DEFAULT_REPLAYED_HEADERS`], extended with
//! [`replay_header`](ReplayLayer::replay_header)); multi-valued headers keep every
//! value; `Set-Cookie`, `WWW-Authenticate` and `Proxy-Authenticate` are never replayed.
//!
//! The layer reads the request body (for the fingerprint) while holding the key. A
//! client that trickles its body would hold the key meanwhile: put a
//! [`BufferRequestBodyLayer`](crate::BufferRequestBodyLayer) outside the lock, as above.
//!
//! # Round trips
//!
//! Under a distributed lock, stack the layers with
//! [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay) on a store kept on the
//! lock's engine, and the lock's own acquisition looks the request's record up:
//!
//! | request | Redis store | PostgreSQL store (`looked_up_by`) | stacked by hand |
//! |---|---|---|---|
//! | replay of a completed key | 1 round trip, no lock taken | 1, no lock taken | 2, then the release |
//! | first request, before the handler | 1 (the acquisition) | 1 (the try) | 2 (acquisition, read) |
//! | first request, after the handler | 1: record written and lock released in one script | 1: the write and the unlock sent together on the lock's session | 1, then the release |
//!
//! (Counted by the servers themselves in `tests/replay`: Redis's `MONITOR`, and a proxy
//! in front of PostgreSQL.) A request that waited for its key (a duplicate in flight)
//! reads the store once it holds the key on PostgreSQL; on Redis each attempt looks.
//!
//! # Stores
//!
//! - [`MemoryStore`]: this process only, bounded by bytes and TTL. Under a distributed
//!   lock backend it is refused: [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay)
//!   panics when the layers are built; layers stacked by hand answer 500 problem+json
//!   (reason `misconfigured`) with one `error` log per layer.
//! - `RedisReplayStore` (features `replay` + `redis`): records beside the lock's keys,
//!   written by a script that checks the lock's fence.
//! - `PostgresReplayStore` (features `replay` + `postgres`): a table, writes ordered by
//!   fencing token, so its lock backend must issue them (`PostgresBackendBuilder::fencing(true)`);
//!   under one that does not, it is refused the same way.
//!
//! # What the fences prevent, and what they do not
//!
//! A record is written after the handler answered, while the request still holds its
//! key. If the holder's lease was lost meanwhile (a pause, a partition) another
//! instance may already run the same key:
//!
//! - Redis: the write lands only if the lock key exists and the key's last fencing
//!   token (in the lock's holder record) is still this request's, in one script — so a holder whose lease was
//!   lost never overwrites or pre-empts its successor's record.
//! - PostgreSQL: the upsert never lets a lower fencing token overwrite a higher one. A
//!   stale holder can still write a record where none exists yet; its successor's
//!   write then replaces it.
//!
//! Neither makes the handler's side effect and the record one atomic step: if the
//! process dies between the handler's answer and the write, or the lease is lost in
//! between, the record is missing and a retry runs the handler again. Only a side
//! effect written in the same transaction as the record (or an idempotent side effect)
//! closes that gap.
//!
//! # Files
//!
//! - `layer.rs`: [`ReplayLayer`], its settings and defaults, and
//!   [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay).
//! - `shared.rs`: what every service of one replay layer value shares (settings,
//!   metric handles per lock layer name).
//! - `service.rs`: [`Replay`]; `future.rs`: [`ReplayFuture`].
//! - `respond.rs`: one request, step by step: admit, read, look up, replay or run
//!   and store; `read_now.rs`: what a request body holds already, read without
//!   waiting.
//! - `lookup.rs`: a request's record named before its key is taken, for the lock's
//!   acquisition to look for.
//! - `record.rs`: [`Record`] and its bytes; `fingerprint.rs`: the request fingerprint,
//!   and the record's scope: its parts and their digest.
//! - `body.rs`: [`ReplayBody`]; `metrics.rs`: the replay metrics.
//! - `store/`: [`ReplayStore`] and the memory, Redis and PostgreSQL stores.

mod body;
mod fingerprint;
mod future;
mod layer;
mod lookup;
mod metrics;
mod read_now;
mod record;
mod rejections;
mod respond;
mod service;
mod shared;
mod store;

pub use body::ReplayBody;
pub use future::ReplayFuture;
pub use layer::{
    LockAndReplay, ReplayLayer, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_STORE_TIMEOUT, DEFAULT_TTL,
};
pub use metrics::{REPLAYED_TOTAL, STORED_TOTAL};
pub use record::{Fingerprint, Record, DEFAULT_REPLAYED_HEADERS};
pub use respond::IDEMPOTENT_REPLAYED;
pub use service::Replay;
#[cfg(feature = "redis")]
pub use store::RedisReplayStore;
pub use store::{MemoryStore, RecordKey, ReplayStore, StoreError, Stored, DEFAULT_MEMORY_CAPACITY};
#[cfg(feature = "postgres")]
pub use store::{PostgresReplayStore, DEFAULT_TABLE};
