//! A cache-stampede guard: when a hot entry is missing, one caller rebuilds it and the
//! others wait for that rebuild instead of each running their own.
//!
//! 100 requests miss the same key at the same moment. Each takes the key's lock from
//! `DistributedLocks`, then reads the cache again (the double-checked read): the first
//! to get the lock finds it still empty and rebuilds it; every later one finds the
//! rebuilt value and returns it. One rebuild instead of 100.
//!
//! Run it with `cargo run --example cache_rebuild`: in process, which guards one
//! instance. With a Redis URL (`cargo run --features redis --example cache_rebuild --
//! redis://127.0.0.1/`) the same code guards every instance that shares the Redis and
//! the cache; the 99 waiters of an instance still cost one contender at Redis. It
//! checks what it shows and exits non-zero otherwise.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Barrier;
use tower_keyed_lock::{DistributedLocks, LockError};

const READERS: usize = 100;
/// How long rebuilding the entry takes (a slow query, a remote call).
const REBUILD: Duration = Duration::from_millis(200);

/// A cache whose misses are rebuilt once per key, however many callers miss at once.
struct Cache {
    entries: RwLock<HashMap<String, Arc<String>>>,
    locks: DistributedLocks,
    misses: AtomicUsize,
    rebuilds: AtomicUsize,
}

impl Cache {
    fn new(locks: DistributedLocks) -> Self {
        Cache {
            entries: RwLock::default(),
            locks,
            misses: AtomicUsize::new(0),
            rebuilds: AtomicUsize::new(0),
        }
    }

    async fn get(&self, key: &str) -> Result<Arc<String>, LockError> {
        if let Some(value) = self.cached(key) {
            return Ok(value);
        }
        self.misses.fetch_add(1, SeqCst);
        // One rebuild per key at a time; the other callers queue here.
        let guard = self.locks.lock(key).await?;
        // Read again: whoever held the lock before us may have rebuilt the entry.
        let value = match self.cached(key) {
            Some(value) => value,
            None => {
                let value = Arc::new(self.rebuild(key).await);
                let mut entries = self.entries.write().unwrap();
                entries.insert(key.to_owned(), value.clone());
                value
            }
        };
        guard.release().await;
        Ok(value)
    }

    fn cached(&self, key: &str) -> Option<Arc<String>> {
        self.entries.read().unwrap().get(key).cloned()
    }

    /// The expensive part, counted.
    async fn rebuild(&self, key: &str) -> String {
        self.rebuilds.fetch_add(1, SeqCst);
        tokio::time::sleep(REBUILD).await;
        format!("the report for {key}")
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let locks = locks(std::env::args().nth(1)).await?;
    let cache = Arc::new(Cache::new(locks));
    let barrier = Arc::new(Barrier::new(READERS));

    let started = Instant::now();
    let readers: Vec<_> = (0..READERS)
        .map(|_| {
            let (cache, barrier) = (cache.clone(), barrier.clone());
            tokio::spawn(async move {
                // All miss at the same moment.
                barrier.wait().await;
                cache.get("dashboard:acme").await
            })
        })
        .collect();
    let mut values = Vec::new();
    for reader in readers {
        values.push(reader.await??);
    }
    let took = started.elapsed();

    let rebuilds = cache.rebuilds.load(SeqCst);
    let misses = cache.misses.load(SeqCst);
    println!("{READERS} readers, {misses} missed the cache, {rebuilds} rebuild, {took:?} in all");
    assert_eq!(rebuilds, 1, "the entry was rebuilt {rebuilds} times");
    assert_eq!(values.len(), READERS);
    assert!(
        values.iter().all(|value| Arc::ptr_eq(value, &values[0])),
        "every reader got the one rebuilt value"
    );
    assert!(misses > 1, "no stampede to guard against: {misses} miss");
    assert!(cache.locks.is_empty(), "a lock was left held");
    println!(
        "ok: one rebuild, and all {READERS} readers got its value: {}",
        values[0]
    );
    Ok(())
}

/// In process, or shared through Redis when a URL is given.
async fn locks(redis_url: Option<String>) -> Result<DistributedLocks, Box<dyn std::error::Error>> {
    match redis_url {
        None => Ok(DistributedLocks::in_process("cache")),
        #[cfg(feature = "redis")]
        Some(url) => {
            let backend = tower_keyed_lock::RedisBackend::connect(&url).await?;
            Ok(DistributedLocks::new("cache", backend))
        }
        #[cfg(not(feature = "redis"))]
        Some(_) => Err("a Redis URL needs the `redis` feature: --features redis".into()),
    }
}
