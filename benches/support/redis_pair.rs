//! The bare safe pair a Redis user writes without a lock library: `SET key token NX
//! PX` to take the key, a compare-and-delete script (`EVALSHA`) to give it back. One
//! copy for every bench that measures against it.

use std::sync::Arc;

use redis::aio::ConnectionManager;

/// The bare safe release: delete the key only if it still holds our token.
pub const COMPARE_AND_DELETE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// The TTL of a bare lock: long enough never to run out within a bench.
const TTL_MS: u64 = 30_000;

/// One connection and the compare-and-delete script: the bare pair on one server.
#[derive(Clone)]
pub struct SafePair {
    pub connection: ConnectionManager,
    script: Arc<redis::Script>,
}

impl SafePair {
    pub async fn new(client: &redis::Client) -> Self {
        Self {
            connection: ConnectionManager::new(client.clone()).await.unwrap(),
            script: Arc::new(redis::Script::new(COMPARE_AND_DELETE)),
        }
    }

    /// `SET lock token NX PX`: whether the key was free.
    pub async fn set(&self, lock: &str, token: &str) -> bool {
        let set: Option<String> = redis::cmd("SET")
            .arg(lock)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(TTL_MS)
            .query_async(&mut self.connection.clone())
            .await
            .unwrap();
        set.is_some()
    }

    /// The compare-and-delete script: whether `token` held the key.
    pub async fn delete(&self, lock: &str, token: &str) -> bool {
        let deleted: i64 = self
            .script
            .key(lock)
            .arg(token)
            .invoke_async(&mut self.connection.clone())
            .await
            .unwrap();
        deleted == 1
    }

    /// One acquire + release of a free `lock` with a fresh token.
    pub async fn round(&self, lock: &str) {
        let token = fresh_token();
        assert!(self.set(lock, &token).await, "the bare key was held");
        self.delete(lock, &token).await;
    }
}

/// Distinct tokens for the bench's bare locks.
pub fn fresh_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let count = NEXT.fetch_add(1, Ordering::Relaxed);
    format!(
        "{:032x}",
        (u128::from(count) << 64) | u128::from(std::process::id())
    )
}
