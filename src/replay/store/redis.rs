//! The Redis store: records beside the lock's keys, writes fenced by the lock.

use std::time::Duration;

use redis::Script;

use crate::backend::redis::{last_token, Connection, RedisBackend};
use crate::backend::{Place, RecordLookup, ReleaseLease};

use super::{Get, Put, RecordKey, ReplayStore, StoreError, Stored};
use crate::replay::record::Record;

/// `KEYS[1]` lock, `KEYS[2]` the lock's holder record (its third line is the last
/// fencing token), `KEYS[3]` record; `ARGV[1]` the request's fencing token, `ARGV[2]` the record, `ARGV[3]` its TTL in ms. Writes only while the lock is
/// held and no grant came after this request's: 1 if written.
const PUT: &str = concat!(
    r"
local record = redis.call('GET', KEYS[2]) or ''
if redis.call('EXISTS', KEYS[1]) == 1 and ",
    last_token!("record"),
    r" == ARGV[1] then
  redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"
);

/// Records in the Redis server of a [`RedisBackend`], under the lock's hash tag:
///
/// ```text
/// {<prefix><name>:<key>}:replay:<scope>    the record, with its TTL
/// ```
///
/// A record is written by one script that checks, atomically, that the lock key exists
/// and that the lock's holder record still carries this request's fencing token: a
/// request whose lease was lost — another instance was granted the key since — cannot
/// write. The request's own lock token is not checked (the layer does not see it);
/// every grant writes a higher fencing token, which covers the same case.
///
/// A record expires with the replay [`ttl`](crate::replay::ReplayLayer::ttl); the
/// lock's holder record expires with the backend's record window
/// ([`fence_ttl`](crate::backend::redis::RedisBackendBuilder::fence_ttl)) after the
/// lock, so nothing of a completed request is left once both expired.
///
/// ```no_run
/// use tower_keyed_lock::backend::redis::RedisBackend;
/// use tower_keyed_lock::replay::{RedisReplayStore, ReplayLayer};
/// use tower_keyed_lock::KeyedLockLayer;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
/// let store = RedisReplayStore::new(&backend);
/// let replay = ReplayLayer::new(store);
/// let lock = KeyedLockLayer::by_header("webhook-id").name("webhooks").backend(backend);
/// # let _ = (replay, lock);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisReplayStore {
    backend: RedisBackend,
    put: Script,
}

impl RedisReplayStore {
    /// A store on the server (or cluster) of `backend`, through its connection and
    /// command timeout: the lock and the record share a hash tag and one script.
    pub fn new(backend: &RedisBackend) -> Self {
        Self {
            backend: backend.clone(),
            put: Script::new(PUT),
        }
    }

    /// The lock, fence and record keys of `key`.
    fn keys(&self, key: &RecordKey) -> [String; 3] {
        let lock = self.backend.lock_key(key.layer(), key.key());
        let tag = lock.strip_suffix(":lock").unwrap_or(&lock);
        let holder = format!("{tag}:holder");
        let record = self.backend.record_key(key.layer(), key.key(), key.scope());
        [lock, holder, record]
    }
}

impl ReplayStore for RedisReplayStore {
    fn get(&self, key: &RecordKey) -> Get {
        let [_, _, record] = self.keys(key);
        let backend = self.backend.clone();
        Box::pin(async move {
            let get = |mut connection: Connection| async move {
                redis::cmd("GET")
                    .arg(record)
                    .query_async(&mut connection)
                    .await
            };
            let bytes: Option<Vec<u8>> = backend.run(get).await.map_err(StoreError::new)?;
            bytes.map(|bytes| Record::from_bytes(&bytes)).transpose()
        })
    }

    fn put(&self, key: &RecordKey, record: Record, ttl: Duration, token: Option<u64>) -> Put {
        let [lock, holder, record_key] = self.keys(key);
        let backend = self.backend.clone();
        let put = self.put.clone();
        Box::pin(async move {
            let token = token.ok_or_else(|| {
                StoreError::new(
                    "the Redis replay store needs the Redis lock backend's fencing token",
                )
            })?;
            let ttl_ms = ttl_millis(ttl);
            let mut invocation = put.key(lock);
            invocation
                .key(holder)
                .key(record_key)
                .arg(token.to_string())
                .arg(record.to_bytes())
                .arg(ttl_ms);
            let write = |mut connection: Connection| async move {
                invocation.invoke_async(&mut connection).await
            };
            let written: i64 = backend.run(write).await.map_err(StoreError::new)?;
            Ok(Stored::from_written(written == 1))
        })
    }

    /// A write checks the fencing token of the request's lock: under a lock backend
    /// that issues none (a `RedlockBackend`) nothing could be stored.
    fn needs_fencing_tokens(&self) -> bool {
        true
    }

    /// The record key, read by the acquire script of this store's own backend (and its
    /// clones), which grants nothing when the record is there.
    fn lookup(&self, key: &RecordKey) -> Option<RecordLookup> {
        let record = self.backend.record_key(key.layer(), key.key(), key.scope());
        Some(RecordLookup {
            place: Place::Redis {
                engine: self.backend.engine_id(),
                key: record,
            },
        })
    }

    /// One script: written only while the lock exists and the fence counter still
    /// holds `token`, as a [`put`](ReplayStore::put); then the lock is deleted and its
    /// release announced.
    fn put_and_release(
        &self,
        key: &RecordKey,
        record: &Record,
        ttl: Duration,
        token: u64,
        _release: &dyn ReleaseLease,
    ) -> Option<Put> {
        let backend = self.backend.clone();
        let key = key.clone();
        let bytes = record.to_bytes();
        let ttl_ms = ttl_millis(ttl);
        Some(Box::pin(async move {
            let names = (key.layer(), key.key(), key.scope());
            let written = backend
                .put_and_release(names, token, bytes, ttl_ms)
                .await
                .map_err(StoreError::new)?;
            Ok(Stored::from_written(written))
        }))
    }
}

/// A record's time to live as the scripts take it: whole milliseconds, at least one
/// (Redis refuses an expiry of zero).
fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl std::fmt::Debug for RedisReplayStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisReplayStore")
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}
