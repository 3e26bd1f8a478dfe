//! The testkit's two renewal checks on a machine too loaded to serve a holder: Redis
//! stops answering for two leases while the check's first key is held, so the holder's
//! renewals go unanswered and it is told its lease is lost (unreachable). That is no
//! breach, and no failure of renewal either: the check starts over on another key, and
//! passes once Redis answers again.
#![cfg(feature = "redis")]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::AsyncCommands;
use tokio::time::Instant;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::testkit::{
    a_released_lease_is_never_renewed, renewal_keeps_a_key_held_past_several_leases, Deployment,
};

use crate::support::fixtures::{Fixture, Redis};
use crate::support::logs::Captured;

/// Renewal: Redis stalls while the first holder holds the check's first key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_renewal_check_starts_over_after_a_signalled_loss() {
    starts_over_when_redis_stalls_under("conformance-renewal", 1, |redis| async move {
        renewal_keeps_a_key_held_past_several_leases(&*redis).await
    })
    .await;
}

/// Release: Redis stalls while the second holder (after the first released) holds the
/// check's first key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_released_lease_check_starts_over_after_a_signalled_loss() {
    starts_over_when_redis_stalls_under("conformance-renewed", 2, |redis| async move {
        a_released_lease_is_never_renewed(&*redis).await
    })
    .await;
}

/// Runs `check` on Redis, which stops answering for two leases once the `holder`-th
/// holder of the check's first key (lock `name`) holds it; the check must pass, and say
/// that it started over.
async fn starts_over_when_redis_stalls_under<C, F>(name: &str, holder: usize, check: C)
where
    C: FnOnce(Arc<Redis>) -> F,
    F: Future<Output = ()>,
{
    let logs = Captured::default();
    let _logging = logs.install();
    let redis = Arc::new(Redis::start());
    let lock_key = RedisBackend::builder(redis.0.client())
        .build()
        .await
        .expect("a backend to name Redis keys")
        .lock_key(name, "k1");
    let stall = 2 * redis.loss_bound();
    let stalled = {
        let (redis, mut connection) = (redis.clone(), redis.0.connection().await);
        tokio::spawn(async move {
            let limit = Instant::now() + 10 * redis.loss_bound();
            let mut holders = Vec::new();
            while holders.len() < holder {
                let token: Option<String> = connection.get(&lock_key).await.expect("GET");
                if let Some(token) = token.filter(|token| !holders.contains(token)) {
                    holders.push(token);
                    continue;
                }
                assert!(
                    Instant::now() < limit,
                    "the check's first key never had holder {holder}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            redis.0.pause();
            tokio::time::sleep(stall).await;
            redis.0.resume();
        })
    };
    check(redis.clone()).await;
    stalled
        .await
        .expect("Redis stalled under the chosen holder");
    assert!(
        logs.text().contains("starting over"),
        "holder {holder} of the first key, its renewals unanswered for {stall:?}, kept it: \
         the stall did not test what it is meant to"
    );
}
