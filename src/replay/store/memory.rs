//! The in-process store: a `quick_cache` bounded by total bytes, with a TTL per record.
//! A request finds its record by its parts ([`RecordPlace`]), without a digest.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use quick_cache::sync::Cache;
use quick_cache::Weighter;
use tokio::time::Instant;

use super::{Get, Put, RecordKey, RecordPlace, ReplayStore, Stored};
use crate::replay::record::Record;

/// The longest request body kept beside its record: a retry's body is compared with it
/// byte for byte. A longer one is compared by the fingerprint's digest, so that a
/// record costs at most this much more than its response.
const KEPT_BODY_LIMIT: usize = 4 * 1024;

/// The default [`MemoryStore::new`] capacity: 64 MiB of records.
pub const DEFAULT_MEMORY_CAPACITY: u64 = 64 * 1024 * 1024;

/// Records in this process's memory, at most `capacity` bytes in all (the least
/// recently used go first, by `quick_cache`'s CLOCK-Pro policy), each until its TTL.
///
/// With the built-in fingerprint the replay layer keeps a copy of each record's request
/// body beside it, up to 4 KiB (a retry's body is compared with it, in place of a
/// digest); the copy counts against the capacity.
///
/// Per instance: with a distributed lock backend it is refused (500), since a duplicate
/// that reaches another instance would not find the record. Use the Redis or PostgreSQL
/// store there.
#[derive(Clone)]
pub struct MemoryStore {
    cache: Arc<Cache<RecordKey, Found, ByteWeight>>,
}

/// A record, and the body of the request that made it when the replay layer kept it:
/// with the built-in fingerprint, a retry in the same scope (so the same method, path
/// and query) matches exactly when its body is the same, and the bodies are compared
/// in place of the digests.
#[derive(Clone)]
pub(crate) struct Found {
    pub(crate) record: Arc<Record>,
    pub(crate) request_body: Option<Bytes>,
    expires_at: Instant,
}

#[derive(Clone)]
struct ByteWeight;

impl Weighter<RecordKey, Found> for ByteWeight {
    fn weight(&self, key: &RecordKey, found: &Found) -> u64 {
        let request = found.request_body.as_ref().map_or(0, Bytes::len);
        (key.weight() + request + found.record.weight()) as u64
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

    /// The record at `place`, unless it expired (then it goes): shared with the cache,
    /// so a replay copies only what its response needs.
    pub(crate) fn find(&self, place: &RecordPlace<'_>) -> Option<Found> {
        let found = self.cache.get(place)?;
        if found.expires_at <= Instant::now() {
            self.cache.remove(place);
            return None;
        }
        Some(found)
    }

    /// Stores `record` under `key` for `ttl`, with a copy of the body of the request
    /// that made it (see [`Found`]) if it is at most [`KEPT_BODY_LIMIT`] bytes: a copy,
    /// as hyper's body is a slice of the connection's read buffer.
    pub(crate) fn keep(
        &self,
        key: &RecordKey,
        record: Record,
        ttl: Duration,
        request_body: Option<Bytes>,
    ) {
        let found = Found {
            record: Arc::new(record),
            request_body: request_body
                .filter(|body| body.len() <= KEPT_BODY_LIMIT)
                .map(|body| Bytes::copy_from_slice(&body)),
            expires_at: Instant::now() + ttl,
        };
        // A record heavier than the whole capacity is not kept by the cache.
        self.cache.insert(key.clone(), found);
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(DEFAULT_MEMORY_CAPACITY)
    }
}

impl ReplayStore for MemoryStore {
    fn get(&self, key: &RecordKey) -> Get {
        let found = self
            .find(&key.place())
            .map(|found| Record::clone(&found.record));
        Box::pin(async move { Ok(found) })
    }

    /// Writes at once: in process the lock table itself fences, as the request still
    /// holds its key while the layer stores.
    fn put(&self, key: &RecordKey, record: Record, ttl: Duration, _token: Option<u64>) -> Put {
        self.keep(key, record, ttl, None);
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
    use crate::key::Key;
    use crate::layer::LayerName;
    use crate::replay::fingerprint::{Head, ScopeOf};
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
        let key = Key::new(key, 256).unwrap();
        RecordKey::new(&LayerName::Static("test"), &key, Head::new(&request, None))
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

    fn record_key(
        layer: &'static str,
        key: &str,
        method: &str,
        uri: &str,
        principal: Option<&str>,
    ) -> RecordKey {
        let request = http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap();
        let key = Key::new(key, 256).unwrap();
        let head = Head::new(&request.into_parts().0, principal);
        RecordKey::new(&LayerName::Static(layer), &key, head)
    }

    /// What the layer keeps is found by a request's place and by its record key, and
    /// what is put through `ReplayStore` by its place: one table, keyed by the scope's
    /// parts, whichever way in.
    #[tokio::test]
    async fn a_record_is_found_by_the_request_and_by_its_key() {
        let store = MemoryStore::default();
        let ttl = Duration::from_secs(60);
        let kept = record_key("orders", "k", "POST", "/orders/1?x=1", Some("alice"));
        store.keep(
            &kept,
            record(b"kept"),
            ttl,
            Some(Bytes::from_static(b"request")),
        );
        let put = record_key("orders", "k", "POST", "/orders/2", None);
        store.put(&put, record(b"put"), ttl, None).await.unwrap();

        let place = |key: &RecordKey| {
            let found = store.find(&key.place());
            found.map(|found| (found.record.body().clone(), found.request_body))
        };
        assert_eq!(
            place(&kept),
            Some((
                Bytes::from_static(b"kept"),
                Some(Bytes::from_static(b"request"))
            ))
        );
        assert_eq!(place(&put), Some((Bytes::from_static(b"put"), None)));
        assert_eq!(store.get(&kept).await.unwrap(), Some(record(b"kept")));
    }

    /// A request that differs in any part of its record's place finds nothing.
    #[test]
    fn a_request_in_another_place_finds_nothing() {
        let store = MemoryStore::default();
        let stored = record_key("orders", "k", "POST", "/orders/1?x=1", Some("alice"));
        store.keep(&stored, record(b"x"), Duration::from_secs(60), None);
        let finds = |key: RecordKey| store.find(&key.place()).is_some();
        assert!(finds(record_key(
            "orders",
            "k",
            "POST",
            "/orders/1?x=1",
            Some("alice")
        )));
        for other in [
            record_key("refunds", "k", "POST", "/orders/1?x=1", Some("alice")),
            record_key("orders", "k2", "POST", "/orders/1?x=1", Some("alice")),
            record_key("orders", "k", "PUT", "/orders/1?x=1", Some("alice")),
            record_key("orders", "k", "POST", "/orders/2?x=1", Some("alice")),
            record_key("orders", "k", "POST", "/orders/1?x=2", Some("alice")),
            record_key("orders", "k", "POST", "/orders/1", Some("alice")),
            record_key("orders", "k", "POST", "/orders/1?x=1", Some("bob")),
            record_key("orders", "k", "POST", "/orders/1?x=1", None),
        ] {
            assert!(!finds(other.clone()), "{other:?}");
        }
    }

    /// A request body over the limit is not kept: its retry is compared by digest.
    #[test]
    fn a_request_body_over_the_limit_is_not_kept() {
        let store = MemoryStore::default();
        let ttl = Duration::from_secs(60);
        for (len, kept) in [(KEPT_BODY_LIMIT, true), (KEPT_BODY_LIMIT + 1, false)] {
            store.keep(
                &key("a"),
                record(b"x"),
                ttl,
                Some(Bytes::from(vec![0; len])),
            );
            let found = store.find(&key("a").place()).unwrap();
            assert_eq!(found.request_body.is_some(), kept, "a body of {len} bytes");
        }
    }

    /// The request body kept beside a record counts against the capacity.
    #[test]
    fn a_kept_request_body_counts_in_the_weight() {
        let store = MemoryStore::default();
        let ttl = Duration::from_secs(60);
        store.keep(&key("a"), record(b"x"), ttl, None);
        let without = store.cache.weight();
        store.keep(
            &key("a"),
            record(b"x"),
            ttl,
            Some(Bytes::from(vec![0; 1000])),
        );
        assert_eq!(store.cache.weight(), without + 1000);
    }

    /// hyper hands a request its URI and body as slices of the connection's read
    /// buffer: a record kept for hours must not keep that buffer alive with them.
    #[test]
    fn a_kept_record_holds_no_buffer_of_its_request() {
        let read_buffer = Bytes::from(format!("/orders/1?x=1{}", " ".repeat(64 * 1024)));
        let uri = http::Uri::from_maybe_shared(read_buffer.slice(..13)).unwrap();
        let (parts, ()) = http::Request::post(uri).body(()).unwrap().into_parts();
        let key = Key::new("k", 256).unwrap();
        let record_key = RecordKey::new(&LayerName::Static("test"), &key, Head::new(&parts, None));
        drop(parts);
        let store = MemoryStore::default();
        let body = read_buffer.slice(1..7);
        store.keep(
            &record_key,
            record(b"x"),
            Duration::from_secs(60),
            Some(body),
        );
        drop(record_key);
        assert!(
            read_buffer.is_unique(),
            "the store keeps the request's read buffer"
        );
        let place_key = Key::new("k", 256).unwrap();
        let (parts, ()) = http::Request::post("/orders/1?x=1")
            .body(())
            .unwrap()
            .into_parts();
        let layer = LayerName::Static("test");
        let found = store.find(&RecordPlace::new(
            &layer,
            &place_key,
            ScopeOf::new(&parts, None),
        ));
        assert_eq!(found.unwrap().request_body.unwrap(), "orders");
    }
}
