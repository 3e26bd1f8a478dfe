//! The testkit's renewal check on a machine too loaded to serve the holder: Redis
//! stops answering for two leases while the check's first key is held, so the holder's
//! renewals go unanswered and it is told its lease is lost (unreachable). That is no
//! breach, and no failure of renewal either: the check starts over on another key, and
//! passes once Redis answers again.
#![cfg(feature = "redis")]

use std::time::Duration;

use redis::AsyncCommands;
use tokio::time::Instant;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::testkit::{renewal_keeps_a_key_held_past_several_leases, Deployment};

use crate::support::fixtures::{Fixture, Redis};
use crate::support::logs::Captured;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_renewal_check_starts_over_after_a_signalled_loss() {
    let logs = Captured::default();
    let _logging = logs.install();
    let redis = std::sync::Arc::new(Redis::start());
    // The check's first key, as the holder's grant writes it.
    let lock_key = RedisBackend::builder(redis.0.client())
        .build()
        .await
        .expect("a backend to name Redis keys")
        .lock_key("conformance-renewal", "k1");
    let stall = 2 * redis.loss_bound();
    let stalled = {
        let (redis, mut connection) = (redis.clone(), redis.0.connection().await);
        tokio::spawn(async move {
            let limit = Instant::now() + 10 * redis.loss_bound();
            loop {
                let token: Option<String> = connection.get(&lock_key).await.expect("GET");
                if token.is_some() {
                    break;
                }
                assert!(Instant::now() < limit, "the check never took its first key");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            redis.0.pause();
            tokio::time::sleep(stall).await;
            redis.0.resume();
        })
    };
    renewal_keeps_a_key_held_past_several_leases(&*redis).await;
    stalled
        .await
        .expect("Redis stalled while the first key was held");
    assert!(
        logs.text().contains("starting over"),
        "the holder of the first key, its renewals unanswered for {stall:?}, kept it: \
         the stall did not test what it is meant to"
    );
}
