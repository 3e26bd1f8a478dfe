//! The Redis backend against real `redis-server` processes (one per test, on free
//! ports), through real hyper servers: two layers with separate backends are two
//! instances of one service.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use redis::aio::MultiplexedConnection;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower_keyed_lock::backend::redis::{RedisBackend, RedisBackendBuilder};
use tower_keyed_lock::backend::LostReason;
use tower_keyed_lock::{Key, KeyedLockLayer, LockBackend, LockError, PathParam};

use crate::support::fixtures::until;
use crate::support::instances::{
    alternate, gate, gated_router, hold, overlap_router, path_escape, within,
};
use crate::support::recorder::counter;
use crate::support::redis_server::{command_calls, RedisServer};
use crate::support::{serve, Overlap};

type Layer = KeyedLockLayer<PathParam>;

/// A backend on `redis`; the restart guard is off, since every test's server is fresh
/// (`redis_faults.rs` tests the guard).
async fn connect(
    redis: &RedisServer,
    configure: impl FnOnce(RedisBackendBuilder) -> RedisBackendBuilder,
) -> RedisBackend {
    configure(RedisBackend::builder(redis.client()).restart_guard(false))
        .build()
        .await
        .expect("backend connects")
}

/// One instance's layer: the same name everywhere, so instances share Redis keys.
fn layer(backend: RedisBackend) -> Layer {
    KeyedLockLayer::by_path("order_id")
        .name("orders")
        .backend(backend)
}

async fn exists(connection: &mut MultiplexedConnection, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(connection)
        .await
        .unwrap()
        == 1
}

async fn all_keys(connection: &mut MultiplexedConnection) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(connection)
        .await
        .unwrap();
    keys.sort();
    keys
}

async fn script_calls(connection: &mut MultiplexedConnection) -> u64 {
    let calls = command_calls(connection).await;
    calls.get("evalsha").copied().unwrap_or(0) + calls.get("eval").copied().unwrap_or(0)
}

fn sha256_hex(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Renewal moves the lock key's expiry, never its value: over four leases the key keeps
/// the holder's token, with a TTL of at most one lease. (That a renewed holder keeps its
/// key against other instances is the suite's
/// `renewal_keeps_a_key_held_past_several_leases`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewal_keeps_the_token_with_a_ttl_of_at_most_a_lease() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let lease_of = Duration::from_millis(300);
    let backend = connect(&redis, |b| b.lease(lease_of)).await;
    let lock_key = backend.lock_key("direct", "3");
    let key = Key::new("3", 256).unwrap();
    let lease = backend
        .acquire("direct", &key, Duration::ZERO)
        .await
        .unwrap();
    let token: String = redis::cmd("GET")
        .arg(&lock_key)
        .query_async(&mut connection)
        .await
        .unwrap();
    for _ in 0..4 {
        // Time passing is what is tested here: one lease length per round.
        tokio::time::sleep(lease_of).await;
        let (holder_token, ttl): (Option<String>, i64) = redis::pipe()
            .cmd("GET")
            .arg(&lock_key)
            .cmd("PTTL")
            .arg(&lock_key)
            .query_async(&mut connection)
            .await
            .unwrap();
        assert_eq!(holder_token.as_deref(), Some(&*token));
        let most = i64::try_from(lease_of.as_millis()).unwrap();
        assert!(ttl > 0 && ttl <= most, "ttl {ttl}");
        assert!(!lease.signal().is_lost());
    }
    lease.release().await;
    assert!(!exists(&mut connection, &lock_key).await);
}

/// Deletes or overwrites the holder's key in Redis; the holder must see the lease lost
/// within one renewal period.
async fn lease_lost_when(overwrite: bool, layer_name: &'static str) {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    // Renewal every 200 ms; the local deadline alone would take 394 ms or more.
    let lease = Duration::from_millis(600);
    let period = lease / 3;
    let (gate, mut entered) = gate();
    let backend = connect(&redis, |b| b.lease(lease)).await;
    let lock_key = backend.lock_key(layer_name, "4");
    let layer = KeyedLockLayer::by_path("order_id")
        .name(layer_name)
        .backend(backend);
    let server = Arc::new(serve(gated_router(gate.clone()).layer(layer)).await);
    let lost_before = counter(
        "keyed_lock_lease_lost_total",
        layer_name,
        &[("reason", "not_owner")],
    );

    let (holder, info, _) = hold(&server, "/orders/4", &mut entered).await;
    let lease_signal = info.lease().expect("a distributed lease").clone();
    assert!(!lease_signal.is_lost());
    let changed = Instant::now();
    let mut command = redis::cmd(if overwrite { "SET" } else { "DEL" });
    command.arg(&lock_key);
    if overwrite {
        command.arg("someone-else").arg("PX").arg(10_000);
    }
    command.query_async::<()>(&mut connection).await.unwrap();
    within(
        "the lease-lost signal",
        Duration::from_secs(2),
        lease_signal.lost(),
    )
    .await;
    let noticed = changed.elapsed();
    assert!(
        noticed <= period + Duration::from_millis(100),
        "noticed after {noticed:?}"
    );
    assert!(info.is_lease_lost());
    // The engine answered that the lock is someone else's (or no one's).
    assert_eq!(lease_signal.lost_reason(), Some(LostReason::NotOwner));

    gate.open_one();
    let answer = within("the holder", Duration::from_secs(5), holder)
        .await
        .unwrap();
    assert_eq!(
        (answer.status, &*answer.body),
        (StatusCode::OK, "lost=true")
    );
    crate::support::eventually("the lost lease is counted", || {
        counter(
            "keyed_lock_lease_lost_total",
            layer_name,
            &[("reason", "not_owner")],
        ) == lost_before + 1
    })
    .await;
    if overwrite {
        // The release compares tokens: the new owner's key stays.
        let value: Option<String> = redis::cmd("GET")
            .arg(&lock_key)
            .query_async(&mut connection)
            .await
            .unwrap();
        assert_eq!(value.as_deref(), Some("someone-else"));
    }
}

/// Redis freezes (SIGSTOP) after a grant, past the first renewal: the holder's signal
/// says the renewal failed while the lease still holds; once Redis is back, a renewal
/// tried again is answered, the failure clears, and the lease was never lost. The hold
/// counts its failed renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unanswered_renewal_is_told_while_the_lease_holds() {
    let redis = RedisServer::start();
    // Renewal at 2 s, each call bounded by 200 ms; the lease is lost at about 6 s.
    let lease = Duration::from_secs(6);
    let (gate, mut entered) = gate();
    let backend = connect(&redis, |b| {
        b.lease(lease).command_timeout(Duration::from_millis(200))
    })
    .await;
    let layer = KeyedLockLayer::by_path("order_id")
        .name("renewal-failed")
        .backend(backend);
    let server = Arc::new(serve(gated_router(gate.clone()).layer(layer)).await);
    let failed_before = counter("keyed_lock_renewal_failed_total", "renewal-failed", &[]);

    let (holder, info, _) = hold(&server, "/orders/9", &mut entered).await;
    let signal = info.lease().expect("a distributed lease").clone();
    redis.pause();
    within(
        "a failed renewal told",
        lease / 3 + Duration::from_secs(2),
        signal.renewal_failed(),
    )
    .await;
    let told_lost = signal.is_lost();
    let still_valid = signal.valid_until().map(|until| until - Instant::now());
    redis.resume();
    assert!(
        !told_lost,
        "the failed renewal was told only once the lease was lost"
    );
    assert!(signal.renewal_failures() >= 1);
    until("a renewal answered again", || {
        let signal = signal.clone();
        async move { !signal.is_renewal_failing() }
    })
    .await;
    assert!(
        !signal.is_lost(),
        "lost although Redis answered a renewal again (valid for {still_valid:?} more when the failure was told)"
    );

    gate.open_one();
    let answer = within("the holder", Duration::from_secs(5), holder)
        .await
        .unwrap();
    assert_eq!(
        (answer.status, &*answer.body),
        (StatusCode::OK, "lost=false")
    );
    crate::support::eventually("the failed renewals are counted", || {
        counter("keyed_lock_renewal_failed_total", "renewal-failed", &[]) > failed_before
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_key_is_a_lost_lease_within_one_renewal_period() {
    lease_lost_when(false, "lost-deleted").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_overwritten_key_is_a_lost_lease_within_one_renewal_period() {
    lease_lost_when(true, "lost-overwritten").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_hold_ends_a_renewed_lease() {
    let redis = RedisServer::start();
    let connection = redis.connection().await;
    let (gate, mut entered) = gate();
    let backend = connect(&redis, |b| {
        b.lease(Duration::from_millis(300))
            .max_hold(Some(Duration::from_millis(500)))
    })
    .await;
    let lock_key = backend.lock_key("orders", "6");
    let server = Arc::new(serve(gated_router(gate.clone()).layer(layer(backend))).await);

    let (holder, info, at) = hold(&server, "/orders/6", &mut entered).await;
    within(
        "the end of max_hold",
        Duration::from_secs(2),
        info.lease().unwrap().lost(),
    )
    .await;
    let held = at.elapsed();
    // Renewed past one lease (300 ms), lost by max_hold (500 ms − drift).
    assert!(
        held > Duration::from_millis(350) && held < Duration::from_millis(700),
        "{held:?}"
    );
    until("Redis expires the key", || {
        let (mut connection, lock_key) = (connection.clone(), lock_key.clone());
        async move { !exists(&mut connection, &lock_key).await }
    })
    .await;
    assert!(
        at.elapsed() < Duration::from_millis(800),
        "{:?}",
        at.elapsed()
    );
    gate.open_one();
    let answer = within("the holder", Duration::from_secs(5), holder)
        .await
        .unwrap();
    assert_eq!(answer.body, "lost=true");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_fails_closed_or_open_and_the_layer_recovers() {
    let mut redis = RedisServer::start();
    let configure = |b: RedisBackendBuilder| {
        b.lease(Duration::from_millis(600))
            .command_timeout(Duration::from_millis(200))
    };
    // Only the wait bounds the waiting (DESIGN rule 11): with Redis gone, a request
    // fails (or opens) when its wait ends, so the waits here are short.
    const WAIT: Duration = Duration::from_millis(300);
    let (gate, mut entered) = gate();
    let backend_a = connect(&redis, configure).await;
    let server_a = Arc::new(
        serve(gated_router(gate.clone()).layer(layer(backend_a.clone()).wait_timeout(WAIT))).await,
    );
    let open = KeyedLockLayer::by_path("order_id")
        .name("fail-open")
        .wait_timeout(WAIT)
        .backend(connect(&redis, configure).await)
        .fail_open(true);
    let server_open = Arc::new(serve(gated_router(gate.clone()).layer(open)).await);
    let rejected_before = counter(
        "keyed_lock_rejected_total",
        "fail-open",
        &[("reason", "backend")],
    );

    let (holder, info, _) = hold(&server_a, "/orders/1", &mut entered).await;
    redis.stop();

    // The holder cannot renew: its lease is lost at its local deadline.
    let died = Instant::now();
    within(
        "the lease-lost signal",
        Duration::from_secs(3),
        info.lease().unwrap().lost(),
    )
    .await;
    assert!(
        died.elapsed() < Duration::from_millis(700),
        "{:?}",
        died.elapsed()
    );

    // New requests: fail closed, when their wait ends.
    let started = Instant::now();
    let answer = within(
        "a request",
        Duration::from_secs(3),
        server_a.post("/quick/2"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        answer.body.contains(r#""reason":"backend""#),
        "{}",
        answer.body
    );
    assert!(answer.headers.contains_key("retry-after"));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // Or open, when so configured.
    let answer = within(
        "a request",
        Duration::from_secs(3),
        server_open.post("/quick/2"),
    )
    .await;
    assert_eq!((answer.status, &*answer.body), (StatusCode::OK, "ok"));
    assert_eq!(
        counter(
            "keyed_lock_rejected_total",
            "fail-open",
            &[("reason", "backend")]
        ),
        rejected_before + 1
    );

    // Redis comes back (empty) on the same port: the same app recovers.
    redis.restart();
    until("requests succeed again", || {
        let server_a = server_a.clone();
        async move {
            let answer = within(
                "a request",
                Duration::from_secs(3),
                server_a.post("/quick/3"),
            )
            .await;
            answer.status == StatusCode::OK
        }
    })
    .await;
    crate::support::eventually("the subscription is back", || backend_a.is_subscribed()).await;

    gate.open_one();
    let answer = within("the holder", Duration::from_secs(5), holder)
        .await
        .unwrap();
    assert_eq!(
        (answer.status, &*answer.body),
        (StatusCode::OK, "lost=true")
    );
    // And the key the holder had is usable again.
    let answer = within(
        "a request",
        Duration::from_secs(3),
        server_a.post("/quick/1"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_redis_times_out_instead_of_hanging() {
    let redis = RedisServer::start();
    // Only the wait bounds the waiting (DESIGN rule 11): a request retries its
    // unanswered attempts until its wait ends, then fails with 503, not before.
    const WAIT: Duration = Duration::from_millis(300);
    const COMMAND_TIMEOUT: Duration = Duration::from_millis(200);
    let (gate, _entered) = gate();
    let backend = connect(&redis, |b| b.command_timeout(COMMAND_TIMEOUT)).await;
    let server = Arc::new(serve(gated_router(gate).layer(layer(backend).wait_timeout(WAIT))).await);
    assert_eq!(server.post("/quick/1").await.status, StatusCode::OK);

    redis.pause();
    let started = Instant::now();
    let answer = within(
        "the request to a paused Redis",
        Duration::from_secs(3),
        server.post("/quick/1"),
    )
    .await;
    let took = started.elapsed();
    redis.resume();
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    // The last attempt ends with the wait; the first has a whole command timeout.
    assert!(took >= WAIT.min(COMMAND_TIMEOUT), "{took:?}");
    assert!(took < WAIT + 2 * COMMAND_TIMEOUT, "{took:?}");

    until("requests succeed again", || {
        let server = server.clone();
        async move {
            let answer = within(
                "a request after resume",
                Duration::from_secs(3),
                server.post("/quick/1"),
            )
            .await;
            answer.status == StatusCode::OK
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_wakes_a_waiter_on_another_instance_at_once() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    // Polling alone would take 5–10 s: only the release message can be fast.
    let configure = |b: RedisBackendBuilder| b.poll_interval(Duration::from_secs(10));
    let (gate, mut entered) = gate();
    let server_a = Arc::new(
        serve(gated_router(gate.clone()).layer(layer(connect(&redis, configure).await))).await,
    );
    let server_b = Arc::new(
        serve(gated_router(gate.clone()).layer(layer(connect(&redis, configure).await))).await,
    );
    let (holder, _, _) = hold(&server_a, "/orders/8", &mut entered).await;

    let before = script_calls(&mut connection).await;
    let waiter = tokio::spawn({
        let server_b = server_b.clone();
        async move { server_b.post("/orders/8").await }
    });
    until("B waits in Redis", || {
        let mut connection = connection.clone();
        async move { script_calls(&mut connection).await > before }
    })
    .await;

    let released = Instant::now();
    gate.open_one();
    let (info, entered_at) = within("the waiter", Duration::from_secs(20), entered.recv())
        .await
        .unwrap();
    let latency = entered_at - released;
    println!("release → waiter on the other instance running: {latency:?}");
    assert!(
        latency < Duration::from_millis(50),
        "the waiter started {latency:?} after the release"
    );
    assert!(info.waited() > latency);
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    gate.open_one();
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_waiters_cost_one_remote_contender() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let overlap = Arc::new(Overlap::default());
    let layer = layer(connect(&redis, |b| b).await);
    let server = Arc::new(
        serve(overlap_router(overlap.clone(), Duration::from_millis(5)).layer(layer.clone())).await,
    );
    // Warm up: the first call of each script loads it (NOSCRIPT, SCRIPT LOAD, EVALSHA).
    assert_eq!(server.post("/orders/1").await.status, StatusCode::OK);
    crate::support::eventually("the table empties", || layer.active_keys() == 0).await;
    let before = script_calls(&mut connection).await;
    let statuses = alternate([&server, &server], "/orders/1", 16).await;
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    crate::support::eventually("the table empties", || layer.active_keys() == 0).await;
    // One acquire and one release script per request: no waiter polls Redis.
    assert_eq!(script_calls(&mut connection).await - before, 2 * 16);
    assert_eq!(overlap.max(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_keys_cannot_reach_other_layers_or_prefixes() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let (gate, mut entered) = gate();
    let long = "k".repeat(100);
    let odd = [
        "plain-key_1.2",
        "a:b",
        "{x}",
        "x}:lock",
        "*",
        "a b",
        "caf\u{e9}",
        "#hash",
        &long,
    ];

    let backend = connect(&redis, |b| b).await;
    let server = Arc::new(serve(gated_router(gate.clone()).layer(layer(backend.clone()))).await);
    let mut holders = Vec::new();
    let mut expected = Vec::new();
    for key in odd {
        let (holder, info, _) = hold(
            &server,
            &format!("/orders/{}", path_escape(key)),
            &mut entered,
        )
        .await;
        assert_eq!(info.key(), key);
        holders.push(holder);
        let part = match key {
            "plain-key_1.2" => key.to_owned(),
            _ => format!("#{}", sha256_hex(key)),
        };
        let lock_key = format!("{{keyed-lock:orders:{part}}}:lock");
        assert_eq!(backend.lock_key("orders", key), lock_key);
        expected.push(lock_key.clone());
        expected.push(lock_key.replace(":lock", ":holder"));
    }
    expected.sort();
    assert_eq!(all_keys(&mut connection).await, expected);
    for key in all_keys(&mut connection).await {
        // One hash tag of plain characters, then `:lock` or `:holder`.
        let (tag, suffix) = key.split_once('}').unwrap();
        let tag = tag.strip_prefix('{').unwrap();
        assert!([":lock", ":holder"].contains(&suffix), "{key}");
        assert!(
            tag.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:#".contains(&b)),
            "{key}"
        );
    }
    gate.finish.add_permits(holders.len());
    for holder in holders {
        assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    }

    // Layer "orders" key "x:y", layer "orders:x" key "y", and prefix "keyed-lock:orders:"
    // layer "x" key "y" would all read `keyed-lock:orders:x:y`: they must not collide.
    let other_layer = KeyedLockLayer::by_path("order_id")
        .name("orders:x")
        .wait_timeout(Duration::ZERO)
        .backend(backend.clone());
    let other_prefix = KeyedLockLayer::by_path("order_id")
        .name("x")
        .wait_timeout(Duration::ZERO)
        .backend(connect(&redis, |b| b.prefix("keyed-lock:orders:")).await);
    let server_layer = Arc::new(serve(gated_router(gate.clone()).layer(other_layer)).await);
    let server_prefix = Arc::new(serve(gated_router(gate.clone()).layer(other_prefix)).await);
    let holders = [
        hold(
            &server,
            &format!("/orders/{}", path_escape("x:y")),
            &mut entered,
        )
        .await,
        hold(&server_layer, "/orders/y", &mut entered).await,
        hold(&server_prefix, "/orders/y", &mut entered).await,
    ];
    let locks: Vec<String> = all_keys(&mut connection)
        .await
        .into_iter()
        .filter(|key| key.ends_with(":lock"))
        .collect();
    assert_eq!(locks.len(), 3, "{locks:?}");
    assert!(
        locks.contains(&"{keyed-lock:orders:x:y}:lock".to_owned()),
        "{locks:?}"
    );
    gate.finish.add_permits(holders.len());
    for (holder, _, _) in holders {
        assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    }
}

/// The PTTL of `key` in ms: -1 without TTL, -2 when it does not exist.
async fn pttl(connection: &mut MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(connection)
        .await
        .unwrap()
}

/// The keys under `prefix` that Redis still holds (`SCAN` leaves out expired ones).
async fn keys_under(connection: &mut MultiplexedConnection, prefix: &str) -> Vec<String> {
    let mut cursor = 0u64;
    let mut found = Vec::new();
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{{{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(connection)
            .await
            .unwrap();
        found.extend(keys);
        if next == 0 {
            return found;
        }
        cursor = next;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fence_counters_expire_by_default_and_stay_with_fence_ttl_none() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let key = Key::new("order-1", 256).unwrap();
    let wait = Duration::from_secs(1);
    let lease_of = Duration::from_millis(200);

    // Opted out: the holder record, with the last token, stays without TTL.
    let backend = connect(&redis, |b| b.fence_ttl(None)).await;
    let lease = backend.acquire("plain", &key, wait).await.unwrap();
    let first = lease.fencing_token().unwrap();
    lease.release().await;
    let holder = backend
        .lock_key("plain", "order-1")
        .replace(":lock", ":holder");
    assert_eq!(pttl(&mut connection, &holder).await, -1);
    let lease = backend.acquire("plain", &key, wait).await.unwrap();
    assert!(lease.fencing_token().unwrap() > first);
    lease.release().await;

    // Default: the holder record lives the lease and one more, then tokens start
    // again above every one given (from the server clock).
    let backend = connect(&redis, |b| b.lease(lease_of)).await;
    let holder = backend
        .lock_key("ttl", "order-1")
        .replace(":lock", ":holder");
    let lease = backend.acquire("ttl", &key, wait).await.unwrap();
    let before = lease.fencing_token().unwrap();
    lease.release().await;
    let left = pttl(&mut connection, &holder).await;
    let most = i64::try_from((lease_of * 2).as_millis()).unwrap();
    assert!(0 < left && left <= most, "{holder}: PTTL {left} ms");
    until("the holder record expires", || {
        let (mut connection, holder) = (connection.clone(), holder.clone());
        async move { !exists(&mut connection, &holder).await }
    })
    .await;
    let lease = backend.acquire("ttl", &key, wait).await.unwrap();
    assert!(lease.fencing_token().unwrap() > before);
    lease.release().await;
}

/// Keys that come from clients, each locked once: with no setting at all, Redis keeps
/// nothing of them once the documented window after their release has passed (the
/// rest of the lease and one more lease: two leases), and a key locked again after
/// that still gets a greater fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn distinct_keys_leave_nothing_after_the_record_window() {
    const KEYS: usize = 1_000;
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let lease_of = Duration::from_millis(300);
    let backend = connect(&redis, |b| b.lease(lease_of).prefix("footprint")).await;
    let wait = Duration::from_secs(5);
    let mut first_token = None;
    for n in 0..KEYS {
        let key = Key::new(&format!("order-{n}"), 256).unwrap();
        let lease = backend.acquire("orders", &key, wait).await.unwrap();
        first_token.get_or_insert(lease.fencing_token().unwrap());
        lease.release().await;
    }
    let released = Instant::now();
    // The last key's holder record is there (the earlier keys' may have gone
    // already, on a slow machine): what the count below must not find.
    let last = format!("footprint:orders:order-{}", KEYS - 1);
    let during = keys_under(&mut connection, &last).await;
    assert_eq!(
        during.len(),
        1,
        "records right after the release: {during:?}"
    );

    // Every grant was sent before `released`: its records expire two leases after it
    // at the latest (a millisecond more for the TTL's rounding).
    tokio::time::sleep_until(released + lease_of * 2 + Duration::from_millis(1)).await;
    let left = keys_under(&mut connection, "footprint:").await;
    assert!(left.is_empty(), "left after the window: {left:?}");

    let key = Key::new("order-0", 256).unwrap();
    let lease = backend.acquire("orders", &key, wait).await.unwrap();
    assert!(lease.fencing_token() > first_token);
    lease.release().await;
}

/// A holder that keeps its key past many leases (renewed) keeps its holder record
/// (and with it the last fencing token): it expires only a window after the lock does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn renewal_keeps_the_records_of_a_long_hold() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let lease_of = Duration::from_millis(150);
    let backend = connect(&redis, |b| b.lease(lease_of).instance_id("long-holder")).await;
    let key = Key::new("order-long", 256).unwrap();
    let lease = backend
        .acquire("long", &key, Duration::from_secs(1))
        .await
        .unwrap();
    let token = lease.fencing_token();
    let record = backend
        .lock_key("long", "order-long")
        .replace(":lock", ":holder");
    // Five leases: the records, written with the grant, would have gone after two.
    let started = Instant::now();
    while started.elapsed() < lease_of * 5 {
        tokio::time::sleep(lease_of / 2).await;
        assert!(!lease.signal().is_lost());
        let holder = backend.holder("long", &key).await.unwrap().unwrap();
        assert_eq!(holder.fencing_token(), token);
        assert_eq!(holder.instance(), Some("long-holder"));
        assert!(exists(&mut connection, &record).await);
    }
    lease.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_backend_alone_times_out_and_releases() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let (a, b) = (connect(&redis, |b| b).await, connect(&redis, |b| b).await);
    let key = Key::new("order-2", 256).unwrap();
    let lease = a.acquire("direct", &key, Duration::ZERO).await.unwrap();
    assert!(!lease.signal().is_lost());

    let started = Instant::now();
    let busy = b.acquire("direct", &key, Duration::from_millis(100)).await;
    assert!(matches!(busy, Err(LockError::Timeout)), "{busy:?}");
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert!(matches!(
        b.acquire("direct", &key, Duration::ZERO).await,
        Err(LockError::Timeout)
    ));

    // A dropped lease is released in the background.
    drop(lease);
    let lock_key = a.lock_key("direct", "order-2");
    until("the dropped lease is released", || {
        let (mut connection, lock_key) = (connection.clone(), lock_key.clone());
        async move { !exists(&mut connection, &lock_key).await }
    })
    .await;
    let lease = b.acquire("direct", &key, Duration::ZERO).await.unwrap();
    lease.release().await;
    assert!(!exists(&mut connection, &lock_key).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquire_dropped_mid_attempt_gives_back_what_it_may_hold() {
    let redis = RedisServer::start();
    let (a, b) = (connect(&redis, |b| b).await, connect(&redis, |b| b).await);
    let key = Key::new("order-3", 256).unwrap();
    // Loads the scripts, so that the attempt below runs when the server wakes up
    // (instead of failing with NOSCRIPT).
    let warm_up = a.acquire("direct", &key, Duration::ZERO).await.unwrap();
    warm_up.release().await;

    // The script is sent to a frozen server and the future dropped before any reply;
    // the server runs it when it wakes up, granting a lease nobody holds.
    redis.pause();
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        a.acquire("direct", &key, Duration::from_secs(5)),
    )
    .await;
    assert!(dropped.is_err());
    redis.resume();

    // Without the give-back the key would stay taken for the whole lease (30 s).
    until("the key is free again", || {
        let (b, key) = (b.clone(), key.clone());
        async move {
            match b.acquire("direct", &key, Duration::ZERO).await {
                Ok(lease) => {
                    lease.release().await;
                    true
                }
                Err(_) => false,
            }
        }
    })
    .await;
}

/// After Redis restarts, requests on every instance are served at once: an attempt
/// that finds its connection dropped ("broken pipe") is retried on the reconnected one
/// instead of answered with 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_first_requests_after_a_redis_restart_are_served() {
    let mut redis = RedisServer::start();
    let mut servers = Vec::new();
    for _ in 0..2 {
        let backend = connect(&redis, |b| b.command_timeout(Duration::from_millis(500))).await;
        let (gate, _entered) = gate();
        servers.push(serve(gated_router(gate).layer(layer(backend))).await);
    }
    for server in &servers {
        assert_eq!(server.post("/quick/1").await.status, StatusCode::OK);
    }

    redis.restart();

    for round in 0..20 {
        for server in &servers {
            let answer = server.post(&format!("/quick/{round}")).await;
            assert_eq!(
                answer.status,
                StatusCode::OK,
                "round {round}: {}",
                answer.body
            );
        }
    }
}

/// Issue 25.3: a server that may evict keys under memory pressure (any `volatile-*` or
/// `allkeys-*` `maxmemory-policy`) can drop a held lock key, and another instance is
/// then granted it before the holder is told. The backend refuses to be built on one,
/// with an error that names the setting and the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicting_maxmemory_policy_is_refused_when_the_backend_is_built() {
    for policy in ["volatile-ttl", "allkeys-lru"] {
        let redis = RedisServer::start_with_args(&["--maxmemory-policy", policy]);
        let built = RedisBackend::builder(redis.client()).build().await;
        let message = built
            .expect_err("built on a server that may evict lock keys")
            .to_string();
        for needed in [
            "maxmemory-policy",
            policy,
            "noeviction",
            "allow_unsafe_eviction_policy(true)",
        ] {
            assert!(message.contains(needed), "{needed:?} not in: {message}");
        }
        // Whoever accepts the risk says so.
        RedisBackend::builder(redis.client())
            .allow_unsafe_eviction_policy(true)
            .build()
            .await
            .expect("the opt-in builds");
    }
}

/// Where `CONFIG` is renamed or disabled (managed Redis services do that), the policy
/// is read from `INFO memory`: an evicting one is still refused, `noeviction` builds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_config_the_policy_is_read_from_info() {
    let no_config = ["--rename-command", "CONFIG", ""];
    let evicting = [&no_config[..], &["--maxmemory-policy", "allkeys-lfu"]].concat();
    let redis = RedisServer::start_with_args(&evicting);
    let message = RedisBackend::builder(redis.client())
        .build()
        .await
        .expect_err("built on a server that may evict lock keys")
        .to_string();
    assert!(message.contains("allkeys-lfu"), "{message}");

    let redis = RedisServer::start_with_args(&no_config);
    RedisBackend::builder(redis.client())
        .restart_guard(false)
        .build()
        .await
        .expect("noeviction, read from INFO, builds");
}

/// What `allow_unsafe_eviction_policy(true)` accepts (issue 25.3): under memory
/// pressure `volatile-ttl` evicts the held lock key (the shortest TTL), and another
/// instance is granted the key while its holder has not been told; the holder learns
/// it only at its next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_unsafe_opt_in_an_evicted_lock_is_granted_before_its_holder_is_told() {
    let redis = RedisServer::start_with_args(&["--maxmemory-policy", "volatile-ttl"]);
    // Long enough that filling memory ends well before the holder's first renewal.
    let lease = Duration::from_secs(6);
    let opt_in = |b: RedisBackendBuilder| b.allow_unsafe_eviction_policy(true).lease(lease);
    let a = connect(&redis, opt_in).await;
    let b = connect(&redis, opt_in).await;
    let mut direct = redis.connection().await;
    let key = Key::new("evicted", 256).unwrap();
    let lock = a.lock_key("orders", "evicted");
    let held = a.acquire("orders", &key, Duration::ZERO).await.unwrap();
    let signal = held.signal().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });

    // Memory runs short: a limit a little above what is used now, then keys that
    // live longer than the lock.
    let memory: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut direct)
        .await
        .unwrap();
    let used: u64 = memory
        .lines()
        .find_map(|line| line.strip_prefix("used_memory:"))
        .and_then(|bytes| bytes.trim().parse().ok())
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used + (1 << 20))
        .query_async(&mut direct)
        .await
        .unwrap();
    let filler = "x".repeat(10_000);
    let mut written = 0;
    while exists(&mut direct, &lock).await {
        let _: () = redis::cmd("SET")
            .arg(format!("filler:{written}"))
            .arg(&filler)
            .arg("EX")
            .arg(3600)
            .query_async(&mut direct)
            .await
            .unwrap();
        written += 1;
        assert!(written < 10_000, "the lock key was never evicted");
    }
    let granted = b
        .acquire("orders", &key, Duration::ZERO)
        .await
        .expect("the evicted key is granted to another instance");
    let granted_at = Instant::now();
    assert!(
        !held.signal().is_lost(),
        "the holder was told before the other instance's grant"
    );
    let told = within("the holder is told", lease, told).await.unwrap();
    println!(
        "evicted lock ({written} filler keys): another instance granted {:?} before \
         the holder was told (lease {lease:?}, renewal every {:?})",
        told - granted_at,
        lease / 3
    );
    granted.release().await;
}

/// Built under `noeviction`, then switched to an evicting policy at run time (`CONFIG
/// SET`): before the periodic re-read, a held key could be evicted and granted to
/// another instance while its holder was never told (an overlap of 489 ms was seen).
/// The backend re-reads the policy every lease/3 (at most 5 s): within that interval
/// plus the read's own limit (two command timeouts) the holder is told its lease is
/// lost, new acquisitions are refused with an error naming the policy, and the health
/// check reports it; back under `noeviction`, grants resume within the same bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicting_policy_set_after_build_tells_holders_and_refuses_grants() {
    let redis = RedisServer::start();
    // A lease far longer than the bound: a holder told within it was told by the
    // policy check, not by its deadline or a renewal.
    let lease = Duration::from_secs(30);
    let command_timeout = Duration::from_secs(2);
    let interval = (lease / 3).min(Duration::from_secs(5));
    let bound = interval + 2 * command_timeout;
    let backend = connect(&redis, |b| b.lease(lease).command_timeout(command_timeout)).await;
    let mut direct = redis.connection().await;
    let key = Key::new("policy", 256).unwrap();
    let held = backend
        .acquire("orders", &key, Duration::ZERO)
        .await
        .unwrap();
    let signal = held.signal().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });

    let set_policy = |policy: &'static str| {
        let mut command = redis::cmd("CONFIG");
        command.arg("SET").arg("maxmemory-policy").arg(policy);
        command
    };
    let _: () = set_policy("volatile-ttl")
        .query_async(&mut direct)
        .await
        .unwrap();
    let changed_at = Instant::now();
    let told = within("the holder is told", bound, told).await.unwrap();
    assert_eq!(held.signal().lost_reason(), Some(LostReason::NotOwner));
    println!(
        "holder told {:?} after the policy changed (bound {bound:?})",
        told - changed_at
    );

    let other = Key::new("policy-other", 256).unwrap();
    let refused = match backend.acquire("orders", &other, Duration::ZERO).await {
        Ok(_) => panic!("granted under volatile-ttl"),
        Err(error) => error,
    };
    let message = format!("{refused}: {:?}", std::error::Error::source(&refused));
    for needed in ["volatile-ttl", "noeviction"] {
        assert!(message.contains(needed), "{needed:?} not in: {message}");
    }
    let health = backend.health().await;
    assert!(!health.is_healthy(), "healthy under volatile-ttl: {health}");
    assert!(health.to_string().contains("volatile-ttl"), "{health}");

    let _: () = set_policy("noeviction")
        .query_async(&mut direct)
        .await
        .unwrap();
    let restored_at = Instant::now();
    let granted = loop {
        match backend.acquire("orders", &other, Duration::ZERO).await {
            Ok(granted) => break granted,
            Err(error) => assert!(
                restored_at.elapsed() < bound,
                "still refused {:?} after noeviction came back: {error}",
                restored_at.elapsed()
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(backend.health().await.is_healthy());
    granted.release().await;
    held.release().await;
}

/// Redis down when the backend is built: the error names the engine and the address
/// (never the password in the URL), then the cause, not a bare "Connection refused
/// (os error 111)".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_server_at_build_is_named_with_its_address_and_cause() {
    // A port that nothing listens on: bound, then freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("redis://locks:s3cret-word@127.0.0.1:{port}/");
    let client = redis::Client::open(url.as_str()).unwrap();
    let built = RedisBackend::builder(client)
        .command_timeout(Duration::from_secs(5))
        .build()
        .await;
    let message = match built {
        Ok(_) => panic!("built with nothing listening on port {port}"),
        Err(error) => error.to_string(),
    };
    println!("{message}");
    let address = format!("127.0.0.1:{port}");
    for needed in ["Redis", address.as_str(), "refused"] {
        assert!(message.contains(needed), "{needed:?} not in: {message}");
    }
    assert!(
        !message.contains("s3cret"),
        "the password leaked: {message}"
    );
}

/// A writer that stops waiting for readers takes its intent back at once: with a 30 s
/// poll interval its entry would keep new readers out for over 30 s, and here a new
/// reader of a third instance gets in well within that (10 s of patience), and the
/// intent set is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_writer_that_gives_up_lets_new_readers_in_at_once() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let configure = |b: RedisBackendBuilder| b.poll_interval(Duration::from_secs(30));
    let instance = |backend: RedisBackend| {
        tower_keyed_lock::DistributedLocks::builder("reports")
            .backend(backend)
            .build()
    };
    let reader = instance(connect(&redis, configure).await);
    let writer = instance(connect(&redis, configure).await);
    let late = instance(connect(&redis, configure).await);
    let held = reader.lock_shared("r").await.unwrap();
    let intent = "{keyed-lock:reports:r}:intent";
    assert!(matches!(
        writer.lock_timeout("r", Duration::from_millis(300)).await,
        Err(LockError::Timeout)
    ));
    let started = Instant::now();
    let entered = loop {
        match late.try_lock_shared("r").await {
            Ok(guard) => break guard,
            Err(LockError::Busy) => {}
            Err(error) => panic!("try_lock_shared failed: {error}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "new readers were kept out after the writer gave up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        !exists(&mut connection, intent).await,
        "the writer's intent is still there"
    );
    entered.release().await;
    held.release().await;
}

/// Issue 32.4: a readiness route on the layer's health check answers 200 with JSON
/// while Redis answers, and 503 naming the error once it is gone, with the last backend
/// error a request met.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_readiness_route_follows_the_backend() {
    let mut redis = RedisServer::start();
    let backend = connect(&redis, |b| b.command_timeout(Duration::from_millis(300))).await;
    let orders = KeyedLockLayer::by_path("order_id")
        .name("health-route")
        .wait_timeout(Duration::from_secs(2))
        .backend(backend);
    let health = orders.health_check();
    let app = axum::Router::new()
        .route(
            "/orders/{order_id}",
            axum::routing::post(|| async { "paid" }),
        )
        .route_layer(orders)
        .route(
            "/ready",
            axum::routing::get(move || async move { health.check().await }),
        );
    let server = serve(app).await;

    let ready = server
        .send(http::Request::get("/ready").body(()).unwrap())
        .await;
    assert_eq!(ready.status, StatusCode::OK, "{ready:?}");
    assert_eq!(ready.headers["content-type"], "application/json");
    assert!(
        ready
            .body
            .starts_with(r#"{"status":"ok","engine":"redis","round_trip_ms":"#),
        "{}",
        ready.body
    );
    assert_eq!(server.post("/orders/1").await.status, StatusCode::OK);

    tokio::task::block_in_place(|| redis.stop());
    let refused = server.post("/orders/1").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    let down = server
        .send(http::Request::get("/ready").body(()).unwrap())
        .await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{down:?}");
    assert!(
        down.body
            .starts_with(r#"{"status":"unavailable","engine":"redis","error":"#),
        "{}",
        down.body
    );
    assert!(down.body.contains(r#""last_error":"#), "{}", down.body);
}

/// Issue 32.4: the health check reports how long the guard still refuses grants, and
/// counts the engine as healthy (it answered); with the guard off it reports none.
#[tokio::test]
async fn the_health_check_reports_the_restart_guards_time_left() {
    let redis = RedisServer::start();
    let lease = Duration::from_secs(5);
    let guarded = RedisBackend::builder(redis.client())
        .lease(lease)
        .restart_guard(true)
        .build()
        .await
        .expect("backend connects");
    let health = guarded.health().await;
    assert!(health.is_healthy(), "{health}");
    let left = health
        .restart_guard_left()
        .unwrap_or_else(|| panic!("no guard reported a moment after the start: {health}"));
    // The guard lasts a lease (plus the second the uptime may round off) from the start.
    assert!(
        left > Duration::ZERO && left <= lease + Duration::from_secs(1),
        "{left:?}"
    );
    assert!(
        health.to_json().contains(r#""restart_guard_left_ms":"#),
        "{}",
        health.to_json()
    );

    let unguarded = RedisBackend::builder(redis.client())
        .lease(lease)
        .restart_guard(false)
        .build()
        .await
        .expect("backend connects");
    let health = unguarded.health().await;
    assert!(health.is_healthy(), "{health}");
    assert_eq!(health.restart_guard_left(), None, "{health}");
}

/// Issue 33: the hand-off's grant is trimmed (one `TIME`, the intent left only by a
/// token that may have entered it); a waiter granted on a release still leaves the
/// writers' intent, takes a larger fencing token, and is the holder on record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_granted_on_a_release_leaves_the_intent_and_is_on_record() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let configure = |b: RedisBackendBuilder| b.poll_interval(Duration::from_secs(30));
    let (a, b) = (
        connect(&redis, configure).await,
        connect(&redis, configure).await,
    );
    let key = Key::new("k", 256).unwrap();
    let intent = a.lock_key("handoff", "k").replace(":lock", ":intent");
    let held = a.acquire("handoff", &key, Duration::ZERO).await.unwrap();
    let waiter = tokio::spawn({
        let (b, key) = (b.clone(), key.clone());
        async move { b.acquire("handoff", &key, Duration::from_secs(20)).await }
    });
    until("B's writer intent is entered", || {
        let (mut connection, intent) = (connection.clone(), intent.clone());
        async move { exists(&mut connection, &intent).await }
    })
    .await;
    let first = held.fencing_token().unwrap();
    held.release().await;
    let granted = within("B's grant", Duration::from_secs(20), waiter)
        .await
        .unwrap()
        .unwrap();
    let token = granted.fencing_token().unwrap();
    assert!(token > first, "{token} after {first}");
    assert!(
        !exists(&mut connection, &intent).await,
        "B is still in the intent set"
    );
    let holder = a.holder("handoff", &key).await.unwrap().unwrap();
    assert_eq!(holder.fencing_token(), Some(token));
    granted.release().await;
}

/// A writer's acquire no longer prunes the readers' set: an expired reader (one that
/// crashed) must not hold it off, while an unexpired one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_unexpired_readers_hold_off_a_writer() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let backend = connect(&redis, |b| b).await;
    let key = Key::new("k", 256).unwrap();
    let readers = backend
        .lock_key("readers", "k")
        .replace(":lock", ":readers");
    let now_ms = |connection: &mut MultiplexedConnection| {
        let mut connection = connection.clone();
        async move {
            let (secs, micros): (u64, u64) = redis::cmd("TIME")
                .query_async(&mut connection)
                .await
                .unwrap();
            secs * 1000 + micros / 1000
        }
    };
    let add_reader = |connection: &mut MultiplexedConnection, expiry: u64, token: &str| {
        let (mut connection, readers, token) =
            (connection.clone(), readers.clone(), token.to_owned());
        async move {
            redis::pipe()
                .cmd("ZADD")
                .arg(&readers)
                .arg(expiry)
                .arg(token)
                .cmd("PEXPIRE")
                .arg(&readers)
                .arg(60_000)
                .query_async::<()>(&mut connection)
                .await
                .unwrap();
        }
    };
    let now = now_ms(&mut connection).await;
    add_reader(&mut connection, now - 1, "crashed").await;
    let lease = backend.acquire("readers", &key, Duration::ZERO).await;
    lease
        .expect("an expired reader holds nothing")
        .release()
        .await;

    let now = now_ms(&mut connection).await;
    add_reader(&mut connection, now + 30_000, "alive").await;
    let refused = backend
        .acquire("readers", &key, Duration::from_millis(200))
        .await;
    assert!(
        matches!(refused, Err(LockError::Timeout)),
        "granted past a live reader"
    );
}
