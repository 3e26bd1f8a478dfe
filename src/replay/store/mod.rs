//! Where records live: the [`ReplayStore`] trait, and the stores that implement it.
//!
//! # Files
//!
//! - `mod.rs`: [`ReplayStore`], [`RecordKey`] and [`Stored`].
//! - `error.rs`: [`StoreError`], which a store returns (and a record that cannot be
//!   read from its bytes).
//! - `memory.rs`: [`MemoryStore`], this process only.
//! - `redis.rs`: `RedisReplayStore`, beside the lock's keys, fenced in one script.
//! - `postgres.rs`: `PostgresReplayStore`, a table with writes ordered by fencing token.

pub(super) mod error;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;

use std::time::Duration;

use crate::backend::{RecordLookup, ReleaseLease};
use crate::key::Key;
use crate::layer::LayerName;
use crate::BoxFuture;

use super::fingerprint::{same, Head, Scope, ScopeOf};
use super::record::Record;

pub use error::StoreError;
pub use memory::{MemoryStore, DEFAULT_MEMORY_CAPACITY};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresReplayStore, DEFAULT_TABLE};
#[cfg(feature = "redis")]
pub use redis::RedisReplayStore;

/// Where a record lives: the lock layer's name, the request key, and the scope (a hex
/// digest of method, route and principal), so one key never replays another endpoint's
/// response.
///
/// Made for every request the replay layer looks up in a shared store (and for a first
/// request in memory), so it copies little: the layer's name is shared with the layer, the key is the lock's, the scope
/// is kept inline, and beside it the method, route, path, query and principal it is a
/// digest of. Keys are compared and hashed by those (two keys' parts are equal exactly
/// when their digests are): the [`MemoryStore`] finds a record by a request's parts,
/// with no digest taken.
#[derive(Clone)]
pub struct RecordKey {
    layer: LayerName,
    key: Key,
    scope: Scope,
    head: Head,
}

impl RecordKey {
    pub(crate) fn new(layer: &LayerName, key: &Key, head: Head) -> Self {
        Self {
            layer: layer.clone(),
            key: key.clone(),
            scope: head.scope().digest(),
            head,
        }
    }

    /// The [`name`](crate::KeyedLockLayer::name) of the lock layer.
    pub fn layer(&self) -> &str {
        self.layer.as_str()
    }

    /// The request key the lock layer extracted.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// The scope: 64 lowercase hex digits.
    pub fn scope(&self) -> &str {
        self.scope.as_str()
    }

    /// Where the record lives, as a request names it.
    pub(crate) fn place(&self) -> RecordPlace<'_> {
        RecordPlace::new(&self.layer, &self.key, self.head.scope())
    }

    /// About how many bytes the key's strings take.
    pub(crate) fn weight(&self) -> usize {
        self.key().len() + self.head.scope().bytes()
    }
}

impl PartialEq for RecordKey {
    fn eq(&self, other: &Self) -> bool {
        self.place() == other.place()
    }
}

impl Eq for RecordKey {}

impl std::hash::Hash for RecordKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.place().hash(state);
    }
}

/// Where a record lives, borrowed from a request: what a [`RecordKey`] is compared and
/// hashed by, so that a request finds its record in memory without making a key.
#[derive(Eq, Hash)]
pub(crate) struct RecordPlace<'a> {
    layer: &'a str,
    key: &'a str,
    scope: ScopeOf<'a>,
}

impl<'a> RecordPlace<'a> {
    pub(crate) fn new(layer: &'a LayerName, key: &'a Key, scope: ScopeOf<'a>) -> Self {
        Self {
            layer: layer.as_str(),
            key: key.as_str(),
            scope,
        }
    }
}

impl PartialEq for RecordPlace<'_> {
    fn eq(&self, other: &Self) -> bool {
        same(self.key, other.key) && same(self.layer, other.layer) && self.scope == other.scope
    }
}

impl quick_cache::Equivalent<RecordKey> for RecordPlace<'_> {
    fn equivalent(&self, key: &RecordKey) -> bool {
        *self == key.place()
    }
}

impl std::fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordKey")
            .field("layer", &self.layer())
            .field("key", &self.key)
            .field("scope", &self.scope)
            .finish()
    }
}

/// What a store did with a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The record was written.
    Written,
    /// The fence refused it: the request no longer holds the key (its lease was lost),
    /// so a later holder's record must win.
    Fenced,
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl Stored {
    /// What a fenced write did: done, or refused by the fence.
    pub(crate) fn from_written(written: bool) -> Self {
        match written {
            true => Stored::Written,
            false => Stored::Fenced,
        }
    }
}

/// What [`ReplayStore::get`] returns: the record, if any, or why the store failed.
pub type Get = BoxFuture<Result<Option<Record>, StoreError>>;

/// What [`ReplayStore::put`] returns: whether the record was written or fenced off.
pub type Put = BoxFuture<Result<Stored, StoreError>>;

/// Keeps the records of completed requests.
///
/// The replay layer calls [`get`](Self::get) while the request holds its key, and
/// [`put`](Self::put) after the inner service answered, still holding the key. Both
/// return boxed futures, as [`LockBackend`](crate::LockBackend) does.
pub trait ReplayStore: Send + Sync + 'static {
    /// The record stored under `key`, unless it is missing or older than its TTL.
    fn get(&self, key: &RecordKey) -> Get;

    /// Stores `record` under `key` for `ttl`, if the request that made it still holds
    /// the key: `token` is its [`LockInfo::fencing_token`](crate::LockInfo::fencing_token).
    fn put(&self, key: &RecordKey, record: Record, ttl: Duration, token: Option<u64>) -> Put;

    /// Whether each instance has a store of its own (the memory store). The replay
    /// layer refuses such a store under a distributed lock: a duplicate that reaches
    /// another instance would run again.
    fn is_per_instance(&self) -> bool {
        false
    }

    /// Whether a write needs the request's fencing token (the PostgreSQL store): the
    /// replay layer refuses such a store under a backend that issues none, where it
    /// could never store.
    fn needs_fencing_tokens(&self) -> bool {
        false
    }

    /// Where `key`'s record lives at the lock's engine, for the lock's remote
    /// acquisition to look for it in its own round trip: a completed request is then
    /// replayed in one round trip without taking its key, and a first request learns
    /// that it is one without a [`get`](Self::get). `None` (the default) for a store
    /// that is not kept on the lock's engine.
    fn lookup(&self, key: &RecordKey) -> Option<RecordLookup> {
        let _ = key;
        None
    }

    /// Stores `record` under `key` for `ttl` and releases the request's lock in one
    /// step, if the lock is still held by the grant of fencing token `token`:
    /// [`put`](Self::put) and the release in one round trip, either by the store itself
    /// (one atomic script) or through the lease's `release`
    /// ([`ReleaseLease::release_writing`]). Called only for a request whose acquisition
    /// looked for this record ([`lookup`](Self::lookup)) and found none, with its
    /// release taken from the lease. `None` (the default) when the store cannot: the
    /// record is then put and the lock released as usual. Anything but
    /// [`Stored::Written`] leaves the lock to `release`, whose release then runs.
    fn put_and_release(
        &self,
        key: &RecordKey,
        record: &Record,
        ttl: Duration,
        token: u64,
        release: &dyn ReleaseLease,
    ) -> Option<Put> {
        let _ = (key, record, ttl, token, release);
        None
    }
}
