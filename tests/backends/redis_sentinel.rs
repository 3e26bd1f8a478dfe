//! The Redis backend with replicas: `wait_for_replicas` (Redis `WAIT` after each grant
//! and renewal), and a Sentinel failover in the middle of a hold. Real `redis-server`
//! and `redis-server --sentinel` processes on free ports.
#![cfg(feature = "redis")]

use std::time::Duration;

use tokio::time::Instant;
use tower_keyed_lock::backend::redis::{RedisBackend, RedisBackendBuilder};
use tower_keyed_lock::{Key, LockBackend, LockError};

use crate::support::fixtures::within;
use crate::support::redis_server::{cli, RedisServer, SENTINEL_MASTER};

fn key(text: &str) -> Key {
    Key::new(text, 256).unwrap()
}

/// A backend on `server` that waits for one replica's acknowledgement. The restart
/// guard is off: the servers are fresh (`redis_faults.rs` tests the guard).
async fn backend(
    server: &RedisServer,
    configure: impl FnOnce(RedisBackendBuilder) -> RedisBackendBuilder,
) -> RedisBackend {
    let builder = RedisBackend::builder(server.client())
        .command_timeout(Duration::from_millis(500))
        .restart_guard(false);
    configure(builder).build().await.expect("backend connects")
}

/// The first grant on fresh replicas: retried, since right after a replica synced it
/// may not acknowledge yet.
async fn first_grant(backend: &RedisBackend, key: &Key) -> tower_keyed_lock::backend::Lease {
    within(
        "the first acknowledged grant",
        Duration::from_secs(10),
        async {
            loop {
                match backend.acquire("ha", key, Duration::ZERO).await {
                    Ok(lease) => break lease,
                    Err(LockError::Backend(_)) => {
                        tokio::time::sleep(Duration::from_millis(50)).await
                    }
                    Err(error) => panic!("{error}"),
                }
            }
        },
    )
    .await
}

fn exists(server: &RedisServer, key: &str) -> bool {
    cli(server.port(), &["EXISTS", key]).trim() == "1"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_waits_for_the_replica_and_is_given_back_when_it_cannot_acknowledge() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let ack = Duration::from_millis(100);
    let backend = backend(&primary, |b| {
        b.wait_for_replicas(1, ack)
            .lease(Duration::from_millis(900))
    })
    .await;

    let lease = first_grant(&backend, &key("a")).await;
    let lock = backend.lock_key("ha", "a");
    // Acknowledged: the replica has the key as soon as the grant returns.
    assert!(
        exists(&replica, &lock),
        "the replica lacks an acknowledged grant"
    );
    lease.release().await;

    // A frozen replica acknowledges nothing: no grant, and nothing left held.
    replica.pause();
    let started = Instant::now();
    let refused = backend.acquire("ha", &key("b"), Duration::ZERO).await;
    let took = started.elapsed();
    assert!(
        matches!(&refused, Err(LockError::Backend(error)) if error.to_string().contains("acknowledged")),
        "{refused:?}"
    );
    assert!(
        took < ack + Duration::from_millis(300),
        "refused after {took:?}"
    );
    let unreplicated = backend.lock_key("ha", "b");
    within(
        "the unacknowledged grant is given back",
        Duration::from_secs(2),
        async {
            while exists(&primary, &unreplicated) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
    )
    .await;

    // An acquisition dropped while it waits for the acknowledgement gives back what it
    // was granted.
    let dropped = {
        let backend = backend.clone();
        tokio::spawn(async move { backend.acquire("ha", &key("d"), Duration::ZERO).await })
    };
    let mid_wait = backend.lock_key("ha", "d");
    within("the grant lands", Duration::from_secs(2), async {
        while !exists(&primary, &mid_wait) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    dropped.abort();
    within(
        "the dropped grant is given back",
        Duration::from_secs(2),
        async {
            while exists(&primary, &mid_wait) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
    )
    .await;

    // A hold whose renewals cannot be acknowledged is lost by its deadline.
    replica.resume();
    let held = backend
        .acquire("ha", &key("c"), Duration::from_secs(1))
        .await
        .unwrap();
    replica.pause();
    within(
        "the lease is lost",
        Duration::from_millis(900) * 2,
        held.signal().lost(),
    )
    .await;
    replica.resume();
}

/// Sentinel fails the primary over while instance A holds a key. Either A's grant
/// was acknowledged by the replica, which now has the key until A's lease runs out,
/// or A is told its lease is lost; and the new primary's tokens are above A's.
///
/// Two replicas, and both must acknowledge: then a renewal the promoted replica did not
/// see is not acknowledged either, and does not extend A's lease. B's grants on the
/// new primary are acknowledged once the other replica and the demoted old primary
/// replicate from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sentinel_failover_mid_hold_keeps_the_key_until_the_holder_is_told() {
    let primary = RedisServer::start();
    let replicas = [
        RedisServer::start_replica_of(&primary),
        RedisServer::start_replica_of(&primary),
    ];
    let sentinel_server = RedisServer::start_sentinel_of(&primary);
    let sentinel = sentinel_server.port();
    within(
        "Sentinel finds the replicas",
        Duration::from_secs(15),
        async {
            loop {
                let known = cli(sentinel, &["SENTINEL", "replicas", SENTINEL_MASTER]);
                if replicas
                    .iter()
                    .all(|r| known.contains(&r.port().to_string()))
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        },
    )
    .await;

    let lease = Duration::from_millis(1500);
    // Every replica must acknowledge. With one of two, this test fails (4 runs of 4):
    // Sentinel promotes one replica while the old primary, not yet demoted, renews
    // A's lease with the other replica's acknowledgement; the promoted one never
    // sees the renewal, expires the key early and grants it to B while A still
    // counts its lease as valid.
    let configure = |b: RedisBackendBuilder| {
        b.wait_for_replicas(2, Duration::from_millis(200))
            .lease(lease)
    };
    let a = backend(&primary, configure).await;
    let key = key("order-1");
    let held = first_grant(&a, &key).await;
    let a_token = held.fencing_token().unwrap();

    // Right after discovery Sentinel may judge a replica unfit (NOGOODSLAVE) until it
    // has talked to it: ask again until it accepts.
    within(
        "Sentinel accepts the failover",
        Duration::from_secs(15),
        async {
            while !cli(sentinel, &["SENTINEL", "FAILOVER", SENTINEL_MASTER]).contains("OK") {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        },
    )
    .await;
    let promoted = within("a replica is promoted", Duration::from_secs(15), async {
        loop {
            let address = cli(
                sentinel,
                &["SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER],
            );
            let promoted = replicas.iter().find(|r| {
                address.contains(&r.port().to_string())
                    && cli(r.port(), &["ROLE"]).starts_with("master")
            });
            if let Some(promoted) = promoted {
                break promoted;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let promoted_at = Instant::now();

    // Instance B follows Sentinel to the new primary, and contends for the same key.
    let b = backend(promoted, configure).await;
    let granted = within("B's grant", Duration::from_secs(20), async {
        loop {
            match b.acquire("ha", &key, Duration::from_secs(5)).await {
                Ok(lease) => break lease,
                // The other replica may still be syncing with the new primary.
                Err(LockError::Backend(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(error) => panic!("{error}"),
            }
        }
    })
    .await;
    assert!(
        held.signal().is_lost(),
        "B was granted the key on the new primary while A still held it"
    );
    let b_token = granted.fencing_token().unwrap();
    assert!(b_token > a_token, "token {b_token} after {a_token}");
    println!(
        "failover: B granted {:?} after the promotion (lease {lease:?}); tokens {a_token} then {b_token}",
        promoted_at.elapsed()
    );
    granted.release().await;
    drop(held);
}
