//! A release hands the key to the first queued writer (issue 33): the waiter holds it
//! without a round trip of its own, and a waiter that stops waiting, or vanishes,
//! never keeps the key past one lease.

#![cfg(feature = "redis")]

use std::future::Future;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::time::Instant;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::{Key, LockBackend, LockError};

use crate::support::fixtures::{until, within};
use crate::support::redis_server::{command_calls, RedisServer};
use crate::support::tcp_proxy::TcpProxy;

const NAME: &str = "handoff";

/// A backend named `instance`; polls seldom, so only a release message is fast.
async fn backend(client: redis::Client, instance: &str, lease: Duration) -> RedisBackend {
    RedisBackend::builder(client)
        .restart_guard(false)
        .instance_id(instance)
        .lease(lease)
        .poll_interval(Duration::from_secs(30))
        .build()
        .await
        .expect("backend connects")
}

/// The lock's Redis key ending in `suffix` (`:queue`, `:intent`).
fn lock_key(backend: &RedisBackend, suffix: &str) -> String {
    backend.lock_key(NAME, "k").replace(":lock", suffix)
}

/// How many writers are queued for a grant.
async fn queued(connection: &mut MultiplexedConnection, queue: &str) -> u64 {
    redis::cmd("HLEN")
        .arg(queue)
        .query_async(connection)
        .await
        .unwrap()
}

/// Acquire attempts Redis ran (`EVALSHA`; renewals and releases are sent as `EVAL`).
async fn attempts(connection: &mut MultiplexedConnection) -> u64 {
    let calls = command_calls(connection).await;
    calls.get("evalsha").copied().unwrap_or(0)
}

/// Waits until `count` writers are queued.
async fn until_queued(redis: &RedisServer, queue: &str, count: u64) {
    let connection = redis.connection().await;
    until("the writers are queued", || {
        let (mut connection, queue) = (connection.clone(), queue.to_owned());
        async move { queued(&mut connection, &queue).await == count }
    })
    .await;
}

/// The instance the holder record names.
async fn holder_instance(backend: &RedisBackend, key: &Key) -> Option<String> {
    let holder = backend.holder(NAME, key).await.unwrap()?;
    holder.instance().map(str::to_owned)
}

/// Polls `future` while `condition` is awaited, and hands the future back unfinished.
async fn while_polling<F: Future + Unpin>(future: &mut F, condition: impl Future<Output = ()>) {
    tokio::select! {
        biased;
        _ = future => panic!("the acquisition ended before it was queued"),
        () = condition => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_grants_the_key_to_the_queued_writer_in_its_own_round_trip() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let lease = Duration::from_secs(2);
    let a = backend(redis.client(), "a", lease).await;
    let b = backend(redis.client(), "b", lease).await;
    let key = Key::new("k", 256).unwrap();
    let queue = lock_key(&a, ":queue");
    let held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();
    let first = held.fencing_token().unwrap();
    let waiter = tokio::spawn({
        let (b, key) = (b.clone(), key.clone());
        async move { b.acquire(NAME, &key, Duration::from_secs(20)).await }
    });
    until_queued(&redis, &queue, 1).await;

    let before = attempts(&mut connection).await;
    held.release().await;
    let granted = within("B's grant", Duration::from_secs(20), waiter)
        .await
        .unwrap()
        .unwrap();
    // B made no attempt of its own after the release: the one script call is the
    // release itself (sent by SHA1, as acquire attempts are).
    assert_eq!(attempts(&mut connection).await, before + 1);
    let token = granted.fencing_token().unwrap();
    assert!(token > first, "{token} after {first}");
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("b"));
    assert_eq!(queued(&mut connection, &queue).await, 0);

    // The lease a release granted is renewed like any other: held past three leases.
    tokio::time::sleep(3 * lease).await;
    assert!(
        !granted.signal().is_lost(),
        "B lost the key a release granted it"
    );
    let holder = a.holder(NAME, &key).await.unwrap().unwrap();
    assert_eq!(holder.fencing_token(), Some(token));
    granted.release().await;
    assert!(a.holder(NAME, &key).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writers_are_granted_in_the_order_they_queued() {
    let redis = RedisServer::start();
    let lease = Duration::from_secs(30);
    let a = backend(redis.client(), "a", lease).await;
    let key = Key::new("k", 256).unwrap();
    let queue = lock_key(&a, ":queue");
    let mut held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();
    let mut waiters = Vec::new();
    for (count, instance) in (1..).zip(["b", "c", "d"]) {
        let waiter = backend(redis.client(), instance, lease).await;
        let key = key.clone();
        waiters.push(tokio::spawn(async move {
            let lease = waiter.acquire(NAME, &key, Duration::from_secs(20)).await;
            (waiter, lease)
        }));
        until_queued(&redis, &queue, count).await;
    }
    let mut fence = held.fencing_token().unwrap();
    for (waiter, instance) in waiters.into_iter().zip(["b", "c", "d"]) {
        held.release().await;
        let (_backend, lease) = within("the next grant", Duration::from_secs(20), waiter)
            .await
            .unwrap();
        held = lease.unwrap();
        assert_eq!(holder_instance(&a, &key).await.as_deref(), Some(instance));
        let next = held.fencing_token().unwrap();
        assert!(next > fence, "{next} after {fence}");
        fence = next;
    }
    held.release().await;
}

/// B is granted the key by A's release and dropped before it learns so: its drop gives
/// the key back, which hands it on to C at once, not a lease later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_dropped_after_its_grant_hands_the_key_on() {
    let redis = RedisServer::start();
    // C waits less than this lease: only a hand-on lets it in.
    let lease = Duration::from_secs(60);
    let a = backend(redis.client(), "a", lease).await;
    let b = backend(redis.client(), "b", lease).await;
    let c = backend(redis.client(), "c", lease).await;
    let key = Key::new("k", 256).unwrap();
    let queue = lock_key(&a, ":queue");
    let held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();
    let mut b_waits = Box::pin(b.acquire(NAME, &key, Duration::from_secs(20)));
    while_polling(&mut b_waits, until_queued(&redis, &queue, 1)).await;
    let c_waits = tokio::spawn({
        let key = key.clone();
        async move { c.acquire(NAME, &key, Duration::from_secs(20)).await }
    });
    until_queued(&redis, &queue, 2).await;

    held.release().await;
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("b"));
    drop(b_waits);
    let started = Instant::now();
    let granted = within("C's grant", Duration::from_secs(30), c_waits)
        .await
        .unwrap()
        .expect("C is handed the key B gave back");
    println!("B dropped → C granted: {:?}", started.elapsed());
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("c"));
    granted.release().await;
}

/// B stops waiting (dropped, or its wait over) before any release: it leaves the
/// queue, and A's release grants C.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_that_stops_waiting_leaves_the_queue() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let lease = Duration::from_secs(60);
    let a = backend(redis.client(), "a", lease).await;
    let b = backend(redis.client(), "b", lease).await;
    let key = Key::new("k", 256).unwrap();
    let (queue, intent) = (lock_key(&a, ":queue"), lock_key(&a, ":intent"));
    let held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();

    let mut dropped = Box::pin(b.acquire(NAME, &key, Duration::from_secs(20)));
    while_polling(&mut dropped, until_queued(&redis, &queue, 1)).await;
    drop(dropped);
    until_queued(&redis, &queue, 0).await;
    let timed_out = b.acquire(NAME, &key, Duration::from_millis(300)).await;
    assert!(timed_out.is_err(), "B's wait ends without the key");
    until_queued(&redis, &queue, 0).await;
    let intent_len: u64 = redis::cmd("ZCARD")
        .arg(&intent)
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(intent_len, 0, "B left the writers' intent");

    let c = backend(redis.client(), "c", lease).await;
    let c_waits = tokio::spawn({
        let key = key.clone();
        async move { c.acquire(NAME, &key, Duration::from_secs(20)).await }
    });
    until_queued(&redis, &queue, 1).await;
    held.release().await;
    let granted = within("C's grant", Duration::from_secs(30), c_waits)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("c"));
    granted.release().await;
}

/// B's instance is cut off while queued (a crash, a partition): it cannot leave, so a
/// release within its entry's life grants it the key, which then goes to C when B's
/// lease expires, not before, and not later. The stall is B's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_waiter_cut_off_holds_a_granted_key_one_lease_at_most() {
    let redis = RedisServer::start();
    let b_lease = Duration::from_secs(2);
    let a = backend(redis.client(), "a", Duration::from_secs(60)).await;
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", redis.port()).parse().unwrap()).await;
    let through_proxy = redis::Client::open(format!("redis://{}/", proxy.host_port())).unwrap();
    let b = backend(through_proxy, "b", b_lease).await;
    let key = Key::new("k", 256).unwrap();
    let queue = lock_key(&a, ":queue");
    let held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();
    let mut b_waits = Box::pin(b.acquire(NAME, &key, Duration::from_secs(20)));
    while_polling(&mut b_waits, until_queued(&redis, &queue, 1)).await;
    proxy.blackhole();
    drop(b_waits);
    drop(b);
    let c = backend(redis.client(), "c", Duration::from_secs(60)).await;
    let c_waits = tokio::spawn({
        let key = key.clone();
        async move { c.acquire(NAME, &key, Duration::from_secs(20)).await }
    });
    until_queued(&redis, &queue, 2).await;

    let first = held.fencing_token().unwrap();
    held.release().await;
    let released = Instant::now();
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("b"));
    let granted = within("C's grant", Duration::from_secs(30), c_waits)
        .await
        .unwrap()
        .expect("C gets the key once B's lease is over");
    let stall = released.elapsed();
    println!("release → C granted past B, cut off: {stall:?} (B's lease {b_lease:?})");
    assert!(stall >= b_lease - Duration::from_millis(50), "{stall:?}");
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("c"));
    assert!(granted.fencing_token().unwrap() > first);
    granted.release().await;
}

/// B's subscription is gone when A's release grants it the key (closed, and refused
/// when it tries again): B's next poll finds the key its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grant_whose_message_is_lost_is_found_by_the_next_attempt() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let a = backend(redis.client(), "a", Duration::from_secs(30)).await;
    let b = RedisBackend::builder(redis.client())
        .restart_guard(false)
        .instance_id("b")
        .poll_interval(Duration::from_millis(300))
        .build()
        .await
        .expect("backend connects");
    let key = Key::new("k", 256).unwrap();
    let queue = lock_key(&a, ":queue");
    let held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();
    let first = held.fencing_token().unwrap();
    let waiter = tokio::spawn({
        let key = key.clone();
        async move { b.acquire(NAME, &key, Duration::from_secs(20)).await }
    });
    until_queued(&redis, &queue, 1).await;
    for command in [
        &["ACL", "SETUSER", "default", "-subscribe", "-ssubscribe"][..],
        &["CLIENT", "KILL", "TYPE", "pubsub"],
    ] {
        redis::cmd(command[0])
            .arg(&command[1..])
            .query_async::<redis::Value>(&mut connection)
            .await
            .unwrap();
    }

    let before = attempts(&mut connection).await;
    held.release().await;
    // Granted by the release itself, before B's next poll.
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("b"));
    let granted = within("B's grant", Duration::from_secs(20), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(
        attempts(&mut connection).await > before,
        "B heard of its grant: the message was not lost"
    );
    let token = granted.fencing_token().unwrap();
    assert!(token > first, "{token} after {first}");
    assert_eq!(holder_instance(&a, &key).await.as_deref(), Some("b"));
    granted.release().await;
    assert!(a.holder(NAME, &key).await.unwrap().is_none());
}

/// A writer that does not wait (`try_lock`, a zero wait) is refused and gone: it must
/// not queue, or the holder's release would grant it the key, held by no one until its
/// give-back hands it on. Found under load: the conformance suite's holder check read
/// such a grant right after a release, when the give-back ran late. Redis's own count
/// of `HSET` (the queue's only writer) shows whether the refused attempt queued,
/// whatever the give-back's timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_writer_that_does_not_wait_is_not_queued() {
    let redis = RedisServer::start();
    let mut connection = redis.connection().await;
    let lease = Duration::from_secs(30);
    let a = backend(redis.client(), "a", lease).await;
    let b = backend(redis.client(), "b", lease).await;
    let key = Key::new("k", 256).unwrap();
    let held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();

    let queue_writes = |calls: std::collections::BTreeMap<String, u64>| calls.get("hset").copied();
    let before = queue_writes(command_calls(&mut connection).await);
    for _ in 0..3 {
        let refused = b.acquire(NAME, &key, Duration::ZERO).await;
        assert!(
            matches!(refused, Err(tower_keyed_lock::LockError::Timeout)),
            "{refused:?}"
        );
    }
    assert_eq!(queue_writes(command_calls(&mut connection).await), before);

    // Released at once, the key is free: no one was granted it.
    held.release().await;
    assert!(a.holder(NAME, &key).await.unwrap().is_none());
    let again = b.acquire(NAME, &key, Duration::ZERO).await;
    assert!(again.is_ok(), "{:?}", again.err());
}

/// A wait that ends has left the queue by the time its caller hears it: a release right
/// after frees the key instead of granting it to the waiter that gave up (whose
/// give-back then came later, so that a `try_lock` right after a 409 found the key
/// held). A current-thread runtime and a blocking look at Redis: no task of the backend
/// runs between the wait's end and the look.
#[tokio::test(flavor = "current_thread")]
async fn a_wait_that_ends_has_left_the_queue_when_it_returns() {
    let redis = RedisServer::start();
    let lease = Duration::from_secs(60);
    let a = backend(redis.client(), "a", lease).await;
    let b = backend(redis.client(), "b", lease).await;
    let key = Key::new("k", 256).unwrap();
    let queue = lock_key(&a, ":queue");
    let held = a.acquire(NAME, &key, Duration::ZERO).await.unwrap();

    let timed_out = b.acquire(NAME, &key, Duration::from_millis(300)).await;
    assert!(
        matches!(timed_out, Err(LockError::Timeout)),
        "{timed_out:?}"
    );
    let mut blocking = redis.client().get_connection().unwrap();
    let queued: u64 = redis::cmd("HLEN").arg(&queue).query(&mut blocking).unwrap();
    assert_eq!(queued, 0, "B was still queued when its wait returned");

    held.release().await;
    let again = b.acquire(NAME, &key, Duration::ZERO).await;
    assert!(
        again.is_ok(),
        "the key is free after the release: {again:?}"
    );
    again.unwrap().release().await;
}
