//! [`ReplayLayer`] and its settings.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use http::request::Parts;
use http::{Extensions, StatusCode};
use tower_layer::Layer;

use super::fingerprint::fingerprint;
use super::lookup::LookupFirst;
use super::record::DEFAULT_REPLAYED_HEADERS;
use super::service::Replay;
use super::shared::{Settings, Shared, NO_FENCING_TOKENS};
use super::store::{MemoryStore, ReplayStore};

use crate::{KeyedLock, KeyedLockLayer};

/// The default [`ttl`](ReplayLayer::ttl): 24 hours.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// The default [`max_response_bytes`](ReplayLayer::max_response_bytes): 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// The default [`max_request_bytes`](ReplayLayer::max_request_bytes): 1 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// The default [`store_timeout`](ReplayLayer::store_timeout): 2 s.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);

/// Replays the stored response of a completed request to later requests with the same
/// key; goes *inside* a [`KeyedLockLayer`](crate::KeyedLockLayer):
/// [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay), or
/// `.layer(replay).layer(lock)` on an axum `Router`. Stacked outside the lock (or with
/// no lock layer), where no request holds its key yet, it answers every routed request
/// 500 problem+json (reason `misconfigured`) and logs one `error`. See the
/// [module docs](super).
#[derive(Clone)]
#[must_use]
pub struct ReplayLayer {
    settings: Settings,
    shared: Arc<Shared>,
}

impl ReplayLayer {
    /// Replays from `store`, with the defaults: records kept [`DEFAULT_TTL`], request
    /// fingerprints checked (422 on a mismatch), responses up to
    /// [`DEFAULT_MAX_RESPONSE_BYTES`] stored, 5xx not stored, fail closed (503) when
    /// the store is unreachable.
    pub fn new(store: impl ReplayStore) -> Self {
        // A store in this process's memory answers at once: the lock layer reads it
        // before taking the key (`KeyedLockLayer::replay`).
        let memory = (&store as &dyn std::any::Any)
            .downcast_ref::<MemoryStore>()
            .cloned();
        Self {
            settings: Settings {
                store: Arc::new(store),
                memory,
                ttl: DEFAULT_TTL,
                max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
                read_timeout: crate::buffer::DEFAULT_READ_TIMEOUT,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
                fingerprint: true,
                fingerprint_fn: None,
                mismatch_status: StatusCode::UNPROCESSABLE_ENTITY,
                store_server_errors: false,
                fail_open: false,
                store_timeout: DEFAULT_STORE_TIMEOUT,
                replayed_headers: DEFAULT_REPLAYED_HEADERS.to_vec(),
                principal: None,
            },
            shared: Arc::default(),
        }
    }

    /// How long a record is replayed (default [`DEFAULT_TTL`]); after that the key
    /// makes a new request.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.settings.ttl = ttl;
        self
    }

    /// Whether a reused key must come with the same request — SHA-256 of method, path,
    /// query and body — (default true); a different one gets the
    /// [`mismatch_status`](Self::mismatch_status). Turn it off for webhooks whose id is
    /// already unique per event.
    pub fn fingerprint(mut self, enabled: bool) -> Self {
        self.settings.fingerprint = enabled;
        self
    }

    /// Compares retries by what `f` picks from the request instead of its whole body:
    /// the fingerprint becomes SHA-256 over the method, path, query and the bytes `f`
    /// returns. Use it when a sender changes part of the body between retries of one
    /// event (a delivery timestamp, an attempt counter) and a retry should still be
    /// replayed, not refused with the [`mismatch_status`](Self::mismatch_status).
    /// Turns fingerprinting on (a later [`fingerprint(false)`](Self::fingerprint) turns
    /// it off again).
    ///
    /// `f` gets the request head and its whole body (read within
    /// [`max_request_bytes`](Self::max_request_bytes)); what it returns stands in for
    /// the body. The record's scope (the lock layer's name, the method, the route, the
    /// path and query, the principal) is the same whatever the fingerprint, so `f`
    /// can only widen what counts as *the same request for this resource*, never make
    /// one resource's key replay another's response. Records stored under one
    /// fingerprint function do not match requests under another (they get the mismatch
    /// status until they expire): change it with care.
    ///
    /// ```
    /// use tower_keyed_lock::replay::{MemoryStore, ReplayLayer};
    ///
    /// // The sender stamps each delivery attempt with `"sent_at"`: compare the rest.
    /// let replay = ReplayLayer::new(MemoryStore::default()).fingerprint_with(|_parts, body| {
    ///     let mut event: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    ///     if let Some(fields) = event.as_object_mut() {
    ///         fields.remove("sent_at");
    ///     }
    ///     serde_json::to_vec(&event).unwrap_or_default()
    /// });
    /// ```
    pub fn fingerprint_with<F, T>(mut self, f: F) -> Self
    where
        F: Fn(&Parts, &Bytes) -> T + Send + Sync + 'static,
        T: AsRef<[u8]>,
    {
        self.settings.fingerprint = true;
        self.settings.fingerprint_fn = Some(Arc::new(move |parts: &Parts, body: &Bytes| {
            fingerprint(parts, f(parts, body).as_ref())
        }));
        self
    }

    /// The answer to a reused key with a different request (default 422 Unprocessable
    /// Content, as the idempotency-key draft says).
    pub fn mismatch_status(mut self, status: StatusCode) -> Self {
        self.settings.mismatch_status = status;
        self
    }

    /// The longest request body read for the fingerprint (default
    /// [`DEFAULT_MAX_REQUEST_BYTES`]); a longer one gets 413. The body is read under the
    /// key: put a [`BufferRequestBodyLayer`](crate::BufferRequestBodyLayer) outside
    /// the lock to read it before.
    pub fn max_request_bytes(mut self, bytes: usize) -> Self {
        self.settings.max_request_bytes = bytes;
        self
    }

    /// How long the request body may take to arrive (default 10 s); then 408.
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.settings.read_timeout = timeout;
        self
    }

    /// The longest response body stored (default [`DEFAULT_MAX_RESPONSE_BYTES`]). A
    /// longer one is passed through as it streams and **not stored**: a retry runs the
    /// handler again.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.settings.max_response_bytes = bytes;
        self
    }

    /// Whether 5xx answers are stored and replayed too (default false: a retry runs
    /// again). 401, 403, 408, 409 and 429 are never stored.
    pub fn store_server_errors(mut self, store: bool) -> Self {
        self.settings.store_server_errors = store;
        self
    }

    /// When the store cannot be read: run the request without replay and without
    /// storing (`true`), or answer 503 with `Retry-After` (`false`, the default).
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.settings.fail_open = fail_open;
        self
    }

    /// How long one store call may take before it counts as unreachable (default
    /// [`DEFAULT_STORE_TIMEOUT`]).
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.settings.store_timeout = timeout;
        self
    }

    /// Adds a response header to replay, besides
    /// [`DEFAULT_REPLAYED_HEADERS`](super::DEFAULT_REPLAYED_HEADERS). `Set-Cookie`,
    /// `WWW-Authenticate` and `Proxy-Authenticate` are never replayed.
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        self.settings.replayed_headers.push(name);
        self
    }

    /// Scopes records to a principal: the `T` an authentication layer put in the
    /// request extensions, so one user's key never replays another user's response. A
    /// request without `T` gets 500 (a misconfiguration, logged once).
    pub fn principal<T>(mut self) -> Self
    where
        T: std::fmt::Display + Send + Sync + 'static,
    {
        self.settings.principal = Some(Arc::new(|extensions: &Extensions| {
            extensions.get::<T>().map(T::to_string)
        }));
        self
    }

    /// Whether the store is per instance, which a distributed lock refuses.
    pub(crate) fn is_per_instance(&self) -> bool {
        self.settings.store.is_per_instance()
    }

    /// Whether the store needs fencing tokens, which a backend without them refuses.
    pub(crate) fn needs_fencing_tokens(&self) -> bool {
        self.settings.store.needs_fencing_tokens()
    }
}

/// A [`KeyedLockLayer`] with a [`ReplayLayer`] inside it: what
/// [`KeyedLockLayer::replay`] returns. Its lock is the layer value it was made from
/// (the same table in this process).
#[derive(Clone)]
#[must_use]
pub struct LockAndReplay<E> {
    lock: KeyedLockLayer<E>,
    replay: ReplayLayer,
    /// Set when the store is kept on the lock's engine or in memory: the lock then
    /// looks for each request's record before it takes the key.
    lookup: Option<Arc<LookupFirst>>,
}

impl<S, E: crate::KeyExtractor> Layer<S> for LockAndReplay<E> {
    type Service = KeyedLock<Replay<S>, E>;

    fn layer(&self, inner: S) -> Self::Service {
        let replay = self.replay.layer(inner);
        match &self.lookup {
            Some(lookup) => self.lock.layer_looking_first(replay, lookup.clone()),
            None => self.lock.layer(replay),
        }
    }
}

impl<E: std::fmt::Debug> std::fmt::Debug for LockAndReplay<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockAndReplay")
            .field("lock", &self.lock)
            .field("replay", &self.replay)
            .field("looks_up_first", &self.lookup.is_some())
            .finish()
    }
}

impl<E: crate::KeyExtractor> KeyedLockLayer<E> {
    /// Stacks `replay` inside this lock, in the one order that works: the key is taken
    /// first, then the store is read — as `.layer(replay).layer(lock)` on an axum
    /// `Router` does, and in fewer round trips when the store is kept on the lock's
    /// engine (the Redis store on its `RedisBackend`, a PostgreSQL store
    /// [`looked_up_by`](super::PostgresReplayStore::looked_up_by) the backend): the
    /// lock's acquisition then looks for the request's record in its own round trip
    /// and takes nothing when it is there, so a completed request is replayed in one
    /// round trip without its key, and a first request's record is written and its
    /// lock released in one more (on Redis in one script; on PostgreSQL the write and
    /// the unlock go together on the lock's session). With the [`MemoryStore`](super::MemoryStore) the lock reads the store
    /// before it takes the key, so a completed request's retry is replayed at once,
    /// whoever holds the key now. The lock keeps this layer value's table: requests
    /// through it and through this layer value elsewhere exclude each other.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_keyed_lock::replay::{MemoryStore, ReplayLayer};
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// let webhooks = KeyedLockLayer::by_header("webhook-id")
    ///     .replay(ReplayLayer::new(MemoryStore::default()).fingerprint(false));
    /// let app: Router = Router::new()
    ///     .route("/webhooks", post(|| async { "processed" }))
    ///     .layer(webhooks);
    /// ```
    ///
    /// # Panics
    /// If this lock has a distributed [`backend`](KeyedLockLayer::backend) and the store
    /// keeps its records per instance (the [`MemoryStore`](super::MemoryStore)): another
    /// instance would run a completed request again. Use the Redis or PostgreSQL store.
    /// Also if the store needs fencing tokens (the PostgreSQL store) and the backend
    /// issues none (a `PostgresBackend` without `fencing(true)`, a `RedlockBackend`):
    /// nothing would ever be stored; the message names the backend's reason if it has
    /// one.
    pub fn replay(self, replay: ReplayLayer) -> LockAndReplay<E> {
        let backend = self.backend_handle();
        assert!(
            !(backend.is_some() && replay.is_per_instance()),
            "KeyedLockLayer::replay: a per-instance store (MemoryStore) behind a distributed \
             lock backend would replay only on the instance that stored the response; use a \
             shared store (RedisReplayStore, PostgresReplayStore)"
        );
        let unfenced = |backend: &&Arc<dyn crate::LockBackend>| {
            replay.needs_fencing_tokens() && !backend.issues_fencing_tokens()
        };
        if let Some(backend) = backend.as_ref().filter(unfenced) {
            match backend.no_fencing_tokens_reason() {
                Some(reason) => panic!(
                    "KeyedLockLayer::replay: the replay store needs fencing tokens (its \
                     writes are fenced by the lock) and {reason}"
                ),
                None => panic!("KeyedLockLayer::replay: {NO_FENCING_TOKENS}"),
            }
        }
        // A store kept on the lock's engine is looked up by the lock's own acquisition;
        // one in this process's memory before the key is taken.
        let looks_up_first = backend.is_some() || replay.settings.memory.is_some();
        let lookup =
            looks_up_first.then(|| Arc::new(LookupFirst::new(Arc::new(replay.settings.clone()))));
        LockAndReplay {
            lock: self,
            replay,
            lookup,
        }
    }
}

impl<S> Layer<S> for ReplayLayer {
    type Service = Replay<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Replay::new(
            inner,
            Arc::new(self.settings.clone()),
            Arc::clone(&self.shared),
        )
    }
}

impl std::fmt::Debug for ReplayLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let settings = &self.settings;
        f.debug_struct("ReplayLayer")
            .field("ttl", &settings.ttl)
            .field("fingerprint", &settings.fingerprint)
            .field("custom_fingerprint", &settings.fingerprint_fn.is_some())
            .field("mismatch_status", &settings.mismatch_status)
            .field("max_request_bytes", &settings.max_request_bytes)
            .field("max_response_bytes", &settings.max_response_bytes)
            .field("store_server_errors", &settings.store_server_errors)
            .field("fail_open", &settings.fail_open)
            .field("per_instance_store", &self.is_per_instance())
            .finish_non_exhaustive()
    }
}
