//! The Redis restart guard as a user meets it: the 503's detail, `Retry-After` and the
//! warning. A process of its own: `tracing` caches whether a log call is wanted from
//! the first thread that reaches it, so another test of the same process reaching the
//! guard's warning first, with no subscriber, would hide it from this one.
#![cfg(all(feature = "redis", feature = "axum"))]

mod support;

use std::time::Duration;

use axum::routing::post;
use axum::Router;
use http::StatusCode;
use support::logs::Captured;
use support::redis_server::RedisServer;
use support::{serve, Server};
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::KeyedLockLayer;

/// One instance on a backend with the restart guard on and `lease`; requests wait
/// `wait` at most.
async fn instance(redis: &RedisServer, lease: Duration, wait: Duration) -> Server {
    let backend = RedisBackend::builder(redis.client())
        .lease(lease)
        .restart_guard(true)
        .build()
        .await
        .expect("backend connects");
    let layer = KeyedLockLayer::by_path("order_id")
        .name("guarded")
        .wait_timeout(wait)
        .backend(backend);
    serve(
        Router::new()
            .route("/orders/{order_id}", post(|| async {}))
            .layer(layer),
    )
    .await
}

/// The server's `uptime_in_seconds`.
fn uptime(redis: &RedisServer) -> u64 {
    support::redis_server::info(redis.port(), "server")
        .lines()
        .find_map(|line| line.strip_prefix("uptime_in_seconds:"))
        .and_then(|seconds| seconds.trim().parse().ok())
        .expect("INFO server has uptime_in_seconds")
}

/// Issue 25.8: for a lease (plus a second) after Redis starts, the restart guard grants
/// nothing, and a request that cannot wait that long gets 503. The answer says why and
/// for how long: its problem detail names the restart guard, its `Retry-After` is the
/// guard's remaining time (rounded up to whole seconds), and one warning per guard
/// period, not one per request, says the same in the logs. (One thread, so that the
/// captured logs see every task.)
#[tokio::test]
async fn the_restart_guard_says_why_and_for_how_long() {
    let captured = Captured::default();
    let _logs = captured.install();
    let redis = RedisServer::start();
    let lease = Duration::from_secs(5);
    let server = instance(&redis, lease, Duration::from_millis(100)).await;

    for round in 0..3 {
        if round == 2 {
            // A second later, the remaining time is a second shorter.
            while uptime(&redis) < 1 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // The guard counts whole seconds of uptime: compare with a second that did
        // not turn during the request.
        let (answer, uptime) = loop {
            let before = uptime(&redis);
            let answer = server.post(&format!("/orders/{round}")).await;
            if uptime(&redis) == before {
                break (answer, before);
            }
        };
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            answer.body
        );
        assert!(answer.body.contains("restart guard"), "{}", answer.body);
        let remaining = lease.as_secs() + 1 - uptime;
        assert_eq!(
            answer.headers["retry-after"],
            remaining.to_string().as_str(),
            "uptime {uptime} s: {}",
            answer.body
        );
        println!(
            "restart guard: Retry-After {remaining} s, detail {}",
            answer.body
        );
    }
    let logs = captured.text();
    let warnings: Vec<_> = logs.lines().filter(|line| line.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "one warning per guard period: {logs}");
    assert!(warnings[0].contains("restart guard"), "{logs}");
}
