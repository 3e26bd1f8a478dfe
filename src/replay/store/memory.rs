//! The in-process store: a `quick_cache` bounded by total bytes, with a TTL per record.

use std::sync::Arc;
use std::time::Duration;

use quick_cache::sync::Cache;
use quick_cache::Weighter;
use tokio::time::Instant;

use super::{Get, Put, RecordKey, ReplayStore, Stored};
use crate::replay::record::Record;

/// The default [`MemoryStore::new`] capacity: 64 MiB of records.
pub const DEFAULT_MEMORY_CAPACITY: u64 = 64 * 1024 * 1024;

/// Records in this process's memory, at most `capacity` bytes in all (the least
/// recently used go first, by `quick_cache`'s CLOCK-Pro policy), each until its TTL.
///
/// Per instance: with a distributed lock backend it is refused (500), since a duplicate
/// that reaches another instance would not find the record. Use the Redis or PostgreSQL
/// store there.
#[derive(Clone)]
pub struct MemoryStore {
    cache: Arc<Cache<RecordKey, Entry, ByteWeight>>,
}

#[derive(Clone)]
struct Entry {
    record: Arc<Record>,
    expires_at: Instant,
}

#[derive(Clone)]
struct ByteWeight;

impl Weighter<RecordKey, Entry> for ByteWeight {
    fn weight(&self, key: &RecordKey, entry: &Entry) -> u64 {
        (key.key().len() + key.scope().len() + entry.record.weight()) as u64
    }
}

impl MemoryStore {
    /// A store of at most `capacity_bytes` bytes of records (see
    /// [`DEFAULT_MEMORY_CAPACITY`]).
    pub fn new(capacity_bytes: u64) -> Self {
        // The estimate sizes the cache's tables; 1 KiB per record is a fair guess.
        let estimated_items = usize::try_from(capacity_bytes / 1024).unwrap_or(usize::MAX);
        Self {
            cache: Arc::new(Cache::with_weighter(
                estimated_items.clamp(16, 1 << 20),
                capacity_bytes,
                ByteWeight,
            )),
        }
    }

    /// Records held now (expired ones count until they are looked up or evicted).
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// The record under `key`, unless it expired (then it goes).
    pub(crate) fn find(&self, key: &RecordKey) -> Option<Record> {
        let entry = self.cache.get(key)?;
        if entry.expires_at <= Instant::now() {
            self.cache.remove(key);
            return None;
        }
        Some(Record::clone(&entry.record))
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(DEFAULT_MEMORY_CAPACITY)
    }
}

impl ReplayStore for MemoryStore {
    fn get(&self, key: &RecordKey) -> Get {
        let found = self.find(key);
        Box::pin(async move { Ok(found) })
    }

    /// Writes at once: in process the lock table itself fences, as the request still
    /// holds its key while the layer stores.
    fn put(&self, key: &RecordKey, record: Record, ttl: Duration, _token: Option<u64>) -> Put {
        let entry = Entry {
            record: Arc::new(record),
            expires_at: Instant::now() + ttl,
        };
        // A record heavier than the whole capacity is not kept by the cache.
        self.cache.insert(key.clone(), entry);
        Box::pin(async { Ok(Stored::Written) })
    }

    fn is_per_instance(&self) -> bool {
        true
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.cache.len())
            .field("weight", &self.cache.weight())
            .field("capacity", &self.cache.capacity())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    fn record(body: &'static [u8]) -> Record {
        Record::new(
            None,
            StatusCode::OK,
            &HeaderMap::new(),
            &[],
            Bytes::from_static(body),
        )
    }

    fn key(key: &str) -> RecordKey {
        let (request, ()) = http::Request::post("/").body(()).unwrap().into_parts();
        let scope = crate::replay::fingerprint::scope(&request, None);
        let key = crate::key::Key::new(key, 256).unwrap();
        RecordKey::new(&crate::layer::LayerName::Static("test"), &key, scope)
    }

    #[tokio::test(start_paused = true)]
    async fn records_expire_after_their_ttl() {
        let store = MemoryStore::default();
        let ttl = Duration::from_secs(60);
        store.put(&key("a"), record(b"x"), ttl, None).await.unwrap();
        assert_eq!(store.get(&key("a")).await.unwrap(), Some(record(b"x")));
        tokio::time::advance(ttl).await;
        assert_eq!(store.get(&key("a")).await.unwrap(), None);
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn total_bytes_stay_within_the_capacity() {
        let store = MemoryStore::new(64 * 1024);
        let body: &'static [u8] = &[b'x'; 1024];
        for i in 0..1000 {
            let written = store.put(
                &key(&i.to_string()),
                record(body),
                Duration::from_secs(60),
                None,
            );
            written.await.unwrap();
        }
        assert!(store.cache.weight() <= 64 * 1024, "{store:?}");
        assert!(store.len() < 64, "{store:?}");
        assert_eq!(store.get(&key("999")).await.unwrap(), Some(record(body)));
    }
}
