//! The DynamoDB backend against a real DynamoDB-compatible server (moto, one per test
//! on a free port), through real hyper servers: two layers with separate backends and
//! clients are two instances of one service.
#![cfg(feature = "dynamodb")]

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_dynamodb::Client;
use axum::Router;
use http::StatusCode;
use tokio::time::Instant;
use tower_keyed_lock::backend::dynamodb::{DynamoDbBackend, DynamoDbBackendBuilder};
use tower_keyed_lock::backend::LostReason;
use tower_keyed_lock::backend::SetupError;
use tower_keyed_lock::{Key, KeyedLockLayer, LockBackend, LockError, PathParam};

use crate::support::fixtures::until;
use crate::support::instances::{gate, gated_router, hold, path_escape, within};
use crate::support::lateness::Lateness;
use crate::support::moto_server::MotoServer;
use crate::support::recorder::counter;
use crate::support::{serve, Server};

type Layer = KeyedLockLayer<PathParam>;
type Item = HashMap<String, AttributeValue>;

const TABLE: &str = "locks";

// ---------------------------------------------------------------- helpers

/// One instance's backend (its own client), on a table it creates if missing.
async fn connect(
    server: &MotoServer,
    configure: impl FnOnce(DynamoDbBackendBuilder) -> DynamoDbBackendBuilder,
) -> DynamoDbBackend {
    let builder = configure(DynamoDbBackend::builder(server.client(), TABLE));
    // moto answers its first requests slowly (it loads its backends).
    let patient = builder.clone().command_timeout(Duration::from_secs(10));
    patient.create_table().await.expect("create the table");
    builder.build().await.expect("backend connects")
}

/// One instance's layer: the same name everywhere, so instances share items.
fn layer(backend: DynamoDbBackend) -> Layer {
    KeyedLockLayer::by_path("order_id")
        .name("orders")
        .backend(backend)
}

/// The lock item with partition key `pk`, read consistently.
async fn item(client: &Client, pk: &str) -> Option<Item> {
    client
        .get_item()
        .table_name(TABLE)
        .key("pk", AttributeValue::S(pk.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .expect("get_item")
        .item
}

fn text(item: &Item, attribute: &str) -> Option<String> {
    item.get(attribute)
        .and_then(|value| value.as_s().ok())
        .cloned()
}

async fn owner(client: &Client, pk: &str) -> Option<String> {
    item(client, pk)
        .await
        .and_then(|item| text(&item, "lock_owner"))
}

/// Writes the item as a holder would that then stops renewing (a crashed instance).
async fn put_holder(client: &Client, pk: &str, rvn: &str, lease: Duration) {
    client
        .put_item()
        .table_name(TABLE)
        .item("pk", AttributeValue::S(pk.to_owned()))
        .item("lock_owner", AttributeValue::S("crashed-instance".into()))
        .item("lock_rvn", AttributeValue::S(rvn.to_owned()))
        .item(
            "lock_lease_ms",
            AttributeValue::N(lease.as_millis().to_string()),
        )
        .item("lock_fence", AttributeValue::N("7".into()))
        .send()
        .await
        .expect("put_item");
}

/// Waits until `server` answers 200 on a quick route. On a loaded machine moto's first
/// answers can outlast a test's short command timeout (the key then waits for its
/// give-back): another key is tried each time, up to 50.
async fn until_up(server: &Server) {
    for attempt in 0..50 {
        let status = server.post(&format!("/quick/up-{attempt}")).await.status;
        if status == StatusCode::OK {
            return;
        }
        eprintln!("before the fault, attempt {attempt}: {status}");
    }
    panic!("moto never granted a key before the fault");
}

/// Whether `backend` gets `key` at once (and gives it back).
async fn free(backend: &DynamoDbBackend, name: &'static str, key: &Key) -> bool {
    match backend.acquire(name, key, Duration::ZERO).await {
        Ok(lease) => {
            lease.release().await;
            true
        }
        Err(_) => false,
    }
}

// ---------------------------------------------------------------- exclusion

/// One key locked and released over and over by two instances in turn: each
/// release's background delete finds the key taken again and is refused, and the item
/// goes after the last release, within the record window.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_keys_item_goes_after_its_last_release() {
    use tower_keyed_lock::backend::dynamodb::{record_window, DEFAULT_COMMAND_TIMEOUT};
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let (a, b) = (connect(&dynamo, |b| b).await, connect(&dynamo, |b| b).await);
    let key = Key::new("hot", 256).unwrap();
    let pk = a.partition_key_value("hot", "hot");
    for turn in 0..20 {
        let backend = if turn % 2 == 0 { &a } else { &b };
        let lease = backend
            .acquire("hot", &key, Duration::from_secs(10))
            .await
            .expect("the key is free between turns");
        lease.release().await;
    }
    let released = Instant::now();
    let limit = record_window(DEFAULT_COMMAND_TIMEOUT) + crate::support::fixtures::PATIENCE;
    while item(&client, &pk).await.is_some() {
        assert!(
            released.elapsed() < limit,
            "the hot key's item stays {limit:?} after its last release"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "hot key: item gone {:?} after the last release",
        released.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fence_tokens_keep_growing_after_the_item_is_deleted() {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let backend = connect(&dynamo, |b| b).await;
    let key = Key::new("order-1", 256).unwrap();
    let pk = backend.partition_key_value("direct", "order-1");

    let lease = backend
        .acquire("direct", &key, Duration::ZERO)
        .await
        .unwrap();
    let first = lease.fencing_token().unwrap();
    lease.release().await;
    let lease = backend
        .acquire("direct", &key, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(lease.fencing_token(), Some(first + 1));
    lease.release().await;

    // What the table's TTL does to an item unused for a day: the counter goes with it.
    client
        .delete_item()
        .table_name(TABLE)
        .key("pk", AttributeValue::S(pk))
        .send()
        .await
        .unwrap();
    let lease = backend
        .acquire("direct", &key, Duration::ZERO)
        .await
        .unwrap();
    let after = lease.fencing_token().unwrap();
    assert!(after > first + 1, "{after} after {first}");
    lease.release().await;
}

// ---------------------------------------------------------------- leases

/// DynamoDB (moto) restarted empty, once its clock is past the last token (two
/// command timeouts and the clock's doubt after the grant: the module docs): another
/// instance's first grant starts from the server's clock, above every token of the
/// lost items, and so does this instance's. (Restarted sooner, another instance's
/// first token was seen 40 µs below the last: the docs say so.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fence_tokens_keep_growing_across_a_server_restarted_empty() {
    let mut dynamo = MotoServer::start();
    let key = Key::new("order-1", 256).unwrap();
    let before = connect(&dynamo, |b| b).await;
    let mut last = 0;
    for _ in 0..3 {
        let lease = before
            .acquire("restart", &key, Duration::ZERO)
            .await
            .unwrap();
        last = lease.fencing_token().unwrap();
        lease.release().await;
    }
    // Two default command timeouts of 1 s, a second of doubt, and 1 % on each.
    tokio::time::sleep(Duration::from_millis(3_100)).await;
    dynamo.restart();
    let after = connect(&dynamo, |b| b).await;
    for backend in [&after, &before] {
        let lease = within(
            "a grant after the restart",
            Duration::from_secs(30),
            backend.acquire("restart", &key, Duration::from_secs(10)),
        )
        .await
        .expect("granted once moto is back");
        let token = lease.fencing_token().unwrap();
        assert!(token > last, "{token} after {last}, across a restart");
        last = token;
        lease.release().await;
    }
}

/// The lock item of a held key names its owner and carries the granted fencing token;
/// each lease of the hold (three renewals) writes a new record version, which is what a
/// waiter watches to tell a live holder from a crashed one; the release clears the
/// owner and the item goes within the record window. (That a renewed holder keeps its
/// key against other instances is the suite's
/// `renewal_keeps_a_key_held_past_several_leases`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_item_carries_the_grant_and_every_lease_a_new_version() {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let lease_of = Duration::from_millis(600);
    let backend = connect(&dynamo, |b| b.lease(lease_of)).await;
    let key = Key::new("3", 256).unwrap();
    let pk = backend.partition_key_value("direct", "3");
    let lease = backend
        .acquire("direct", &key, Duration::ZERO)
        .await
        .expect("a free key");
    let first = item(&client, &pk).await.expect("the lock item");
    let owner_token = text(&first, "lock_owner").expect("an owner");
    let fence = first["lock_fence"].as_n().unwrap().parse::<u64>().unwrap();
    assert_eq!(lease.fencing_token(), Some(fence));
    let mut versions = vec![text(&first, "lock_rvn").unwrap()];
    for _ in 0..3 {
        // Time passing is what is tested here: one lease length (three renewal
        // periods) per round.
        tokio::time::sleep(lease_of).await;
        let now = item(&client, &pk).await.unwrap();
        assert_eq!(text(&now, "lock_owner").as_deref(), Some(&*owner_token));
        versions.push(text(&now, "lock_rvn").unwrap());
        assert!(!lease.signal().is_lost());
    }
    versions.dedup();
    assert_eq!(
        versions.len(),
        4,
        "the record version did not change within a lease: {versions:?}"
    );
    lease.release().await;
    until("the owner is cleared", || {
        let (client, pk) = (client.clone(), pk.clone());
        async move { owner(&client, &pk).await.is_none() }
    })
    .await;
    until("the released item is deleted", || {
        let (client, pk) = (client.clone(), pk.clone());
        async move { item(&client, &pk).await.is_none() }
    })
    .await;
}

/// A holder that stopped renewing (its instance crashed) is taken over one lease
/// after the waiter first saw its record version, timed on the waiter's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_that_stops_changing_is_taken_over_after_one_lease() {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let backend = connect(&dynamo, |b| b).await;
    let key = Key::new("crashed", 256).unwrap();
    let pk = backend.partition_key_value("direct", "crashed");
    let stale = Duration::from_secs(1);
    put_holder(&client, &pk, "v1", stale).await;

    // The waiter sees the record, waits a lease, then replaces it. On a loaded machine
    // moto answers a write in 15 ms or in 200: the bound is half a lease more than one
    // lease (a waiter that waited two leases, or a poll interval past the lease, is
    // still caught) plus three of the slowest round trips seen meanwhile.
    let lateness = Lateness::watch();
    let slowest = Cell::new(Duration::ZERO);
    let reads = async {
        loop {
            let sent = Instant::now();
            item(&client, &pk).await;
            slowest.set(slowest.get().max(sent.elapsed()));
        }
    };
    let started = Instant::now();
    let takeover = backend.acquire("direct", &key, Duration::from_secs(3));
    let lease = within("the takeover", Duration::from_secs(5), async {
        tokio::select! {
            lease = takeover => lease,
            never = reads => never,
        }
    })
    .await
    .expect("taken over");
    let took = started.elapsed();
    let round_trip = slowest.get();
    println!("takeover of a stale record with a 1 s lease after {took:?}");
    assert!(took >= stale, "taken over before a lease: {took:?}");
    let bound = lateness.allowing(stale + stale / 2 + 3 * round_trip);
    assert!(
        took < bound,
        "taken over after {took:?}: more than a lease and a half and three round trips \
         ({round_trip:?} at the slowest) = {bound:?}"
    );
    assert!(lease.fencing_token().unwrap() > 7);
    lease.release().await;

    // A holder that renews (a new version every 100 ms of a 1 s lease: ten times over,
    // so a slow write on a loaded machine is no lapse) is never taken over.
    put_holder(&client, &pk, "v0", stale).await;
    let renewing = tokio::spawn({
        let (client, pk) = (client.clone(), pk.clone());
        async move {
            for version in 1.. {
                tokio::time::sleep(Duration::from_millis(100)).await;
                put_holder(&client, &pk, &format!("v{version}"), stale).await;
            }
        }
    });
    let started = Instant::now();
    let busy = backend
        .acquire("direct", &key, Duration::from_millis(1500))
        .await;
    assert!(matches!(busy, Err(LockError::Timeout)), "{busy:?}");
    assert!(started.elapsed() >= Duration::from_millis(1500));
    renewing.abort();
    assert_eq!(
        owner(&client, &pk).await.as_deref(),
        Some("crashed-instance")
    );
}

/// Clears or overwrites the holder's item; the holder must see the lease lost within
/// one renewal period.
async fn lease_lost_when(overwrite: bool, layer_name: &'static str) {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    // Renewal every 200 ms; the local deadline alone would take 594 ms or more.
    let lease = Duration::from_millis(600);
    let period = lease / 3;
    let (gate, mut entered) = gate();
    let backend = connect(&dynamo, |b| b.lease(lease)).await;
    let pk = backend.partition_key_value(layer_name, "4");
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
    if overwrite {
        put_holder(&client, &pk, "someone-elses", Duration::from_secs(10)).await;
    } else {
        client
            .update_item()
            .table_name(TABLE)
            .key("pk", AttributeValue::S(pk.clone()))
            .update_expression("REMOVE lock_owner")
            .send()
            .await
            .unwrap();
    }
    within(
        "the lease-lost signal",
        Duration::from_secs(2),
        lease_signal.lost(),
    )
    .await;
    let noticed = changed.elapsed();
    assert!(
        noticed <= period + Duration::from_millis(150),
        "noticed after {noticed:?}"
    );
    assert!(info.is_lease_lost());
    // The engine answered that the lock is someone else's (or no one's).
    assert_eq!(lease_signal.lost_reason(), Some(LostReason::NotOwner));

    gate.finish.add_permits(1);
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
        // The release compares tokens: the new owner stays.
        assert_eq!(
            owner(&client, &pk).await.as_deref(),
            Some("crashed-instance")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cleared_owner_is_a_lost_lease_within_one_renewal_period() {
    lease_lost_when(false, "lost-cleared").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_overwritten_owner_is_a_lost_lease_within_one_renewal_period() {
    // Not `lost-overwritten`: the Redis tests of this binary count that layer's losses.
    lease_lost_when(true, "dynamo-lost-overwritten").await;
}

/// The server freezes (SIGSTOP) while a key is held, for three leases. The holder
/// cannot renew and must declare the lease lost at its local deadline; the other
/// instance may only run once the server is back and the holder's record has gone a
/// whole lease unchanged on its clock, which is after the holder's signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_server_loses_the_lease_before_another_instance_gets_the_key() {
    let dynamo = MotoServer::start();
    let lease = Duration::from_millis(600);
    let configure =
        |b: DynamoDbBackendBuilder| b.lease(lease).command_timeout(Duration::from_millis(200));
    let (gate, mut entered) = gate();
    let a = layer(connect(&dynamo, configure).await);
    let b = layer(connect(&dynamo, configure).await).wait_timeout(Duration::from_secs(5));
    let server_a = Arc::new(serve(gated_router(gate.clone()).layer(a)).await);
    let server_b = Arc::new(serve(gated_router(gate.clone()).layer(b)).await);

    let (holder, info, _) = hold(&server_a, "/orders/1", &mut entered).await;
    dynamo.pause();
    let paused = Instant::now();
    // No renewal can be answered from here on: this is the deadline the holder is told
    // at (passed already if this process stalled that long).
    let deadline = info.lease().unwrap().valid_until().unwrap_or(paused);
    // B asks while the server is frozen: it gets 503s (the call times out) and retries.
    let waiter = tokio::spawn({
        let server_b = server_b.clone();
        async move {
            loop {
                let answer = server_b.post("/orders/1").await;
                if answer.status != StatusCode::SERVICE_UNAVAILABLE {
                    return answer;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    within(
        "the lease-lost signal",
        Duration::from_secs(3),
        info.lease().unwrap().lost(),
    )
    .await;
    let lost_at = Instant::now();
    // A lease at most from the last renewal before the freeze (timers on a loaded
    // machine fire late, so the signal's own deadline is what is checked).
    assert!(
        deadline <= paused + lease,
        "the holder's deadline was {:?} after the freeze, more than a lease",
        deadline - paused
    );
    assert!(info.lease().unwrap().is_lost());
    tokio::time::sleep((3 * lease).saturating_sub(paused.elapsed())).await;
    dynamo.resume();
    let resumed = Instant::now();

    let (_, b_entered_at) = within("B gets the key", Duration::from_secs(10), entered.recv())
        .await
        .unwrap();
    let margin = b_entered_at - lost_at;
    println!(
        "paused for {:?}: A's lease lost {:?} after the freeze; B entered {margin:?} after \
         that",
        3 * lease,
        deadline.saturating_duration_since(paused)
    );
    assert!(
        b_entered_at > lost_at,
        "B ran before A's lease was declared lost"
    );
    // B watched the record a whole lease after it could see it again.
    let watched = b_entered_at - resumed;
    assert!(watched >= lease, "B took over {watched:?} after the resume");
    gate.finish.add_permits(2);
    assert_eq!(holder.await.unwrap().body, "lost=true");
    assert_eq!(waiter.await.unwrap().status, StatusCode::OK);
}

// ---------------------------------------------------------------- outages

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_server_times_out_instead_of_hanging_and_fails_open_if_asked() {
    // Only the wait bounds the waiting (DESIGN rule 11): a request retries its
    // unanswered attempts until its wait ends, then fails (or opens), not before.
    const WAIT: Duration = Duration::from_millis(300);
    const COMMAND_TIMEOUT: Duration = Duration::from_millis(200);
    // An attempt the paused server runs once resumed can land after its give-back
    // gave up: the lease bounds how long that item holds the key.
    const LEASE: Duration = Duration::from_secs(2);
    let dynamo = MotoServer::start();
    let configure = |b: DynamoDbBackendBuilder| b.command_timeout(COMMAND_TIMEOUT).lease(LEASE);
    let (gate, _entered) = gate();
    let server = Arc::new(
        serve(
            gated_router(gate.clone())
                .layer(layer(connect(&dynamo, configure).await).wait_timeout(WAIT)),
        )
        .await,
    );
    let open = KeyedLockLayer::by_path("order_id")
        // Not `fail-open`: the Redis tests of this binary count that layer's rejections.
        .name("dynamo-fail-open")
        .wait_timeout(WAIT)
        .backend(connect(&dynamo, configure).await)
        .fail_open(true);
    let server_open = Arc::new(serve(gated_router(gate).layer(open)).await);
    until_up(&server).await;
    let lateness = Lateness::watch();

    dynamo.pause();
    let started = Instant::now();
    let answer = within(
        "the request to a paused server",
        Duration::from_secs(3),
        server.post("/quick/1"),
    )
    .await;
    let took = started.elapsed();
    let answer_open = within(
        "the fail-open request",
        Duration::from_secs(3),
        server_open.post("/quick/1"),
    )
    .await;
    dynamo.resume();
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        answer.body.contains(r#""reason":"backend""#),
        "{}",
        answer.body
    );
    // The last attempt ends with the wait; the first has a whole command timeout.
    assert!(took >= WAIT.min(COMMAND_TIMEOUT), "{took:?}");
    assert!(
        took < lateness.allowing(WAIT + 2 * COMMAND_TIMEOUT),
        "{took:?}, lateness {:?}",
        lateness.worst()
    );
    assert_eq!(
        (answer_open.status, &*answer_open.body),
        (StatusCode::OK, "ok")
    );

    let resumed = Instant::now();
    until("requests succeed again", || {
        let server = server.clone();
        async move { server.post("/quick/1").await.status == StatusCode::OK }
    })
    .await;
    println!(
        "requests succeed again {:?} after the resume",
        resumed.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_and_restarted_server_fails_closed_then_recovers() {
    // Only the wait bounds the waiting (DESIGN rule 11): with the server gone, a
    // request fails when its wait ends, so the wait here is short.
    const WAIT: Duration = Duration::from_millis(300);
    let mut dynamo = MotoServer::start();
    let configure = |b: DynamoDbBackendBuilder| b.command_timeout(Duration::from_millis(300));
    let (gate, _entered) = gate();
    let server = Arc::new(
        serve(
            gated_router(gate).layer(layer(connect(&dynamo, configure).await).wait_timeout(WAIT)),
        )
        .await,
    );
    until_up(&server).await;

    dynamo.stop();
    let started = Instant::now();
    let answer = server.post("/quick/1").await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );

    // The emulator comes back empty: the table is created again (as infrastructure
    // would), and the same app serves requests without a restart.
    dynamo.restart();
    DynamoDbBackend::builder(dynamo.client(), TABLE)
        .create_table()
        .await
        .unwrap();
    until("requests succeed again", || {
        let server = server.clone();
        async move { server.post("/quick/1").await.status == StatusCode::OK }
    })
    .await;
}

// ---------------------------------------------------------------- cancellation

/// The acquire future dropped at every point of its life: before the call is sent,
/// while it is in flight, after the grant, and in the pauses of a wait. Whatever it
/// got is given back at once: with a 30 s lease, anything left held would block the
/// key far longer than the check allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquire_dropped_at_any_point_leaves_nothing_held() {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let (a, b) = (connect(&dynamo, |b| b).await, connect(&dynamo, |b| b).await);
    let key = Key::new("order-3", 256).unwrap();
    let pk = a.partition_key_value("direct", "order-3");
    assert!(free(&b, "direct", &key).await);

    // A free key: the attempt is cut at 0, 0.5, 1, … 15 ms, across its round trip.
    let mut granted_before_drop = 0;
    for step in 0..=30u64 {
        let cut = Duration::from_micros(500 * step);
        let dropped =
            tokio::time::timeout(cut, a.acquire("direct", &key, Duration::from_secs(5))).await;
        if let Ok(lease) = dropped {
            granted_before_drop += 1;
            drop(lease);
        }
        until("the key is free again", || {
            let (b, key) = (b.clone(), key.clone());
            async move { free(&b, "direct", &key).await }
        })
        .await;
        assert_eq!(owner(&client, &pk).await, None, "cut at {cut:?}");
    }
    println!("{granted_before_drop} of 31 cuts came after the grant");

    // A held key: the waiter is cut while it polls (in a call or in a pause).
    let holder = b.acquire("direct", &key, Duration::ZERO).await.unwrap();
    let holder_token = owner(&client, &pk).await.unwrap();
    for step in 0..10u64 {
        let cut = Duration::from_millis(3 * step);
        let dropped =
            tokio::time::timeout(cut, a.acquire("direct", &key, Duration::from_secs(5))).await;
        assert!(dropped.is_err(), "got a held key");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(owner(&client, &pk).await.as_deref(), Some(&*holder_token));
    holder.release().await;
    // A cut waiter's write that the server ran after the release is given back in the
    // background: the key is free once that has run (a 30 s lease left behind would
    // not be).
    until("the key is free after the holder's release", || {
        let (a, key) = (a.clone(), key.clone());
        async move { free(&a, "direct", &key).await }
    })
    .await;
}

/// The call is sent to a frozen server and the future dropped before any answer; the
/// server applies the write when it wakes up, granting a lease nobody holds. The
/// give-back must clear it rather than leave it for a takeover (30 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquire_dropped_mid_call_gives_back_what_it_may_hold() {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let (a, b) = (connect(&dynamo, |b| b).await, connect(&dynamo, |b| b).await);
    let key = Key::new("order-3", 256).unwrap();
    let pk = a.partition_key_value("direct", "order-3");
    assert!(free(&a, "direct", &key).await);

    dynamo.pause();
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        a.acquire("direct", &key, Duration::from_secs(5)),
    )
    .await;
    assert!(dropped.is_err());
    dynamo.resume();

    until("the key is free again", || {
        let (b, key) = (b.clone(), key.clone());
        async move { free(&b, "direct", &key).await }
    })
    .await;
    assert_eq!(owner(&client, &pk).await, None);
}

// ---------------------------------------------------------------- the item and table

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_keys_get_their_own_items() {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let (gate, mut entered) = gate();
    let long = "k".repeat(100);
    let odd = [
        "plain-key_1.2",
        "a:b",
        "#hash",
        "a b",
        "caf\u{e9}",
        "x}:lock",
        &long,
    ];
    let backend = connect(&dynamo, |b| b).await;
    let server = Arc::new(serve(gated_router(gate.clone()).layer(layer(backend.clone()))).await);
    let mut holders = Vec::new();
    for key in odd {
        let (holder, info, _) = hold(
            &server,
            &format!("/orders/{}", path_escape(key)),
            &mut entered,
        )
        .await;
        assert_eq!(info.key(), key);
        let pk = backend.partition_key_value("orders", key);
        match key {
            "#hash" => assert!(
                pk.starts_with("keyed-lock:orders:#") && pk.len() > 80,
                "{pk}"
            ),
            _ => assert_eq!(pk, format!("keyed-lock:orders:{key}")),
        }
        assert!(owner(&client, &pk).await.is_some(), "{key}");
        holders.push(holder);
    }
    let scan = client.scan().table_name(TABLE).send().await.unwrap();
    assert_eq!(scan.count(), odd.len() as i32);
    gate.finish.add_permits(holders.len());
    for holder in holders {
        assert_eq!(holder.await.unwrap().status, StatusCode::OK);
    }

    // Layer "orders" key "x:y" and layer "orders:x" key "y" must not share an item.
    let other = KeyedLockLayer::by_path("order_id")
        .name("orders:x")
        .wait_timeout(Duration::ZERO)
        .backend(backend.clone());
    let server_other = Arc::new(serve(gated_router(gate.clone()).layer(other)).await);
    let first = hold(
        &server,
        &format!("/orders/{}", path_escape("x:y")),
        &mut entered,
    )
    .await;
    let second = hold(&server_other, "/orders/y", &mut entered).await;
    assert_ne!(first.1.fencing_token(), None);
    assert_eq!(
        backend.partition_key_value("orders:x", "y"),
        "keyed-lock:orders%3Ax:y"
    );
    gate.finish.add_permits(2);
    assert_eq!(first.0.await.unwrap().status, StatusCode::OK);
    assert_eq!(second.0.await.unwrap().status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_single_table_design_with_a_sort_key_and_its_own_names() {
    let dynamo = MotoServer::start();
    let client = dynamo.client();
    let configure = |b: DynamoDbBackendBuilder| {
        b.partition_key("PK")
            .sort_key("SK", "LOCK")
            .ttl_attribute("expires_at")
            .prefix("shop")
    };
    let builder = configure(DynamoDbBackend::builder(dynamo.client(), "app"));
    builder.create_table().await.unwrap();
    builder
        .create_table()
        .await
        .expect("creating it again is fine");
    let backend = builder.build().await.unwrap();
    let key = Key::new("order-1", 256).unwrap();
    let lease = backend
        .acquire("orders", &key, Duration::ZERO)
        .await
        .unwrap();

    let stored = client
        .get_item()
        .table_name("app")
        .key("PK", AttributeValue::S("shop:orders:order-1".into()))
        .key("SK", AttributeValue::S("LOCK".into()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .expect("the lock item");
    assert!(stored.contains_key("lock_owner"));
    let expires: u64 = stored["expires_at"].as_n().unwrap().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Lease + one day by default.
    assert!(
        expires >= now + 86_400 && expires <= now + 86_400 + 60,
        "{expires}"
    );
    let ttl = client
        .describe_time_to_live()
        .table_name("app")
        .send()
        .await
        .unwrap();
    assert_eq!(
        ttl.time_to_live_description()
            .and_then(|d| d.attribute_name()),
        Some("expires_at")
    );
    lease.release().await;

    // A backend whose keys do not match the table's is refused at build time.
    let mismatched = DynamoDbBackend::builder(dynamo.client(), "app")
        .build()
        .await;
    assert!(
        matches!(mismatched, Err(SetupError::Invalid(_))),
        "{mismatched:?}"
    );
    let missing = DynamoDbBackend::builder(dynamo.client(), "no-such-table")
        .build()
        .await;
    assert!(
        matches!(missing, Err(SetupError::Failed { .. })),
        "{missing:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_endpoint_fails_setup_promptly() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let client = crate::support::moto_server::client_for(&format!("http://127.0.0.1:{port}"));
    let started = Instant::now();
    let result = DynamoDbBackend::builder(client, TABLE)
        .command_timeout(Duration::from_millis(300))
        .build()
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let message = result
        .map(|_| ())
        .expect_err("nothing listens there")
        .to_string();
    eprintln!("unreachable at build: {message}");
    named_with_cause(&message, port);
}

/// `message` names DynamoDB and `127.0.0.1:port`, then a cause.
fn named_with_cause(message: &str, port: u16) {
    assert!(message.contains("DynamoDB"), "{message}");
    let address = format!("127.0.0.1:{port}");
    assert!(message.contains(&address), "{message}");
    let address_end = message.find(&address).unwrap() + address.len();
    assert!(message.len() > address_end + 2, "no cause: {message}");
}

/// DynamoDB gone after the build: an acquisition's error names the engine and the
/// endpoint, then the cause (not the SDK's bare "dispatch failure").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_is_named_with_its_address_and_cause() {
    use crate::support::fixtures::Fixture;
    let mut fixture = crate::support::fixtures::DynamoDb::start();
    let locks = fixture.instance("cut-off").await;
    let port = fixture.0.port();
    fixture.0.stop();
    let error = locks
        .try_lock("k")
        .await
        .map(|_| ())
        .expect_err("DynamoDB is down");
    let message = error.to_string();
    eprintln!("unreachable at acquire: {message}");
    named_with_cause(&message, port);
}

// ---------------------------------------------------------------- throttling

/// An HTTP front between an instance and moto that answers the next `throttles`
/// writes (`UpdateItem`) as DynamoDB answers a table over its capacity (HTTP 400,
/// `ProvisionedThroughputExceededException`), and forwards everything else.
struct ThrottlingFront {
    url: String,
    throttles: Arc<std::sync::atomic::AtomicUsize>,
    throttled: Arc<std::sync::atomic::AtomicUsize>,
    forwarded_writes: Arc<std::sync::atomic::AtomicUsize>,
}

impl ThrottlingFront {
    async fn start(upstream: String) -> Self {
        use axum::body::{Body, Bytes};
        use http_body_util::{BodyExt, Full};
        use hyper_util::client::legacy::Client as HttpClient;
        use hyper_util::rt::TokioExecutor;
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

        let throttles = Arc::new(AtomicUsize::new(0));
        let throttled = Arc::new(AtomicUsize::new(0));
        let forwarded_writes = Arc::new(AtomicUsize::new(0));
        let client = HttpClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let forward = {
            let (throttles, throttled) = (throttles.clone(), throttled.clone());
            let forwarded_writes = forwarded_writes.clone();
            move |request: http::Request<Body>| {
                let (client, upstream) = (client.clone(), upstream.clone());
                let (throttles, throttled) = (throttles.clone(), throttled.clone());
                let forwarded_writes = forwarded_writes.clone();
                async move {
                    let target = request.headers().get("x-amz-target").cloned();
                    let is_write = target.is_some_and(|t| t == "DynamoDB_20120810.UpdateItem");
                    let throttle = is_write
                        && throttles
                            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                            .is_ok();
                    if throttle {
                        throttled.fetch_add(1, SeqCst);
                        let kind = "ProvisionedThroughputExceededException";
                        let body = format!(
                            r#"{{"__type":"com.amazonaws.dynamodb.v20120810#{kind}","message":"throttled by the test"}}"#
                        );
                        return http::Response::builder()
                            .status(400)
                            .header("content-type", "application/x-amz-json-1.0")
                            .header("x-amzn-errortype", kind)
                            .body(Body::from(body))
                            .unwrap();
                    }
                    if is_write {
                        forwarded_writes.fetch_add(1, SeqCst);
                    }
                    let (mut parts, body) = request.into_parts();
                    let body = body.collect().await.unwrap().to_bytes();
                    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                    parts.uri = format!("{upstream}{path}").parse().unwrap();
                    let answer = client
                        .request(http::Request::from_parts(parts, Full::new(body)))
                        .await
                        .expect("moto answers");
                    let (parts, body) = answer.into_parts();
                    let body = body.collect().await.unwrap().to_bytes();
                    http::Response::from_parts(parts, Body::from(body))
                }
            }
        };
        let server = serve(Router::new().fallback(forward)).await;
        ThrottlingFront {
            url: format!("http://{}", server.addr),
            throttles,
            throttled,
            forwarded_writes,
        }
    }

    /// Throttles the next `writes` writes.
    fn throttle(&self, writes: usize) {
        self.throttles
            .store(writes, std::sync::atomic::Ordering::SeqCst);
    }

    fn throttled(&self) -> usize {
        self.throttled.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn forwarded_writes(&self) -> usize {
        self.forwarded_writes
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A few throttled writes are retried within the wait: the key is granted. Throttling
/// that never stops ends the wait with `LockError::Backend` (the layer's 503) at the
/// deadline, not with `Timeout` (409, "someone holds it"), and never later. A refused
/// write is known not to be applied, so nothing is given back for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn throttled_writes_are_retried_then_fail_as_backend_errors() {
    let dynamo = MotoServer::start();
    let front = ThrottlingFront::start(dynamo.url()).await;
    connect(&dynamo, |b| b).await; // creates the table
    let backend =
        DynamoDbBackend::builder(crate::support::moto_server::client_for(&front.url), TABLE)
            .command_timeout(Duration::from_secs(2))
            .build()
            .await
            .expect("backend connects");
    let key = Key::new("order-1", 256).unwrap();

    front.throttle(3);
    let lease = within(
        "a throttled acquire",
        Duration::from_secs(10),
        backend.acquire("direct", &key, Duration::from_secs(5)),
    )
    .await
    .expect("granted after the throttling");
    assert_eq!(front.throttled(), 3);
    lease.release().await;

    let wait = Duration::from_millis(800);
    front.throttle(usize::MAX);
    let started = Instant::now();
    let result = within(
        "an acquire throttled to the end",
        Duration::from_secs(10),
        backend.acquire("direct", &key, wait),
    )
    .await;
    let took = started.elapsed();
    front.throttle(0);
    let throttled = front.throttled() - 3;
    eprintln!(
        "throttled to the end: {result:?} after {took:?} ({throttled} attempts), wait {wait:?}"
    );
    match result {
        Err(LockError::Backend(error)) => assert!(
            format!("{error:?}").contains("ProvisionedThroughputExceeded"),
            "{error:?}"
        ),
        other => panic!("expected a backend error, got {other:?}"),
    }
    assert!(throttled > 3, "only {throttled} attempts in {wait:?}");
    assert!(took >= wait, "gave up after {took:?}, before the wait");
    assert!(
        took < wait + Duration::from_millis(300),
        "returned {took:?} after a {wait:?} wait"
    );

    // A refused write was not applied: no attempt's token is given back afterwards.
    let forwarded = front.forwarded_writes();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        front.forwarded_writes(),
        forwarded,
        "writes went on after the wait ended (give-backs of refused attempts)"
    );

    // Nothing was written, so nothing is held: the key is free at once.
    let lease = backend
        .acquire("direct", &key, Duration::ZERO)
        .await
        .expect("the key is free");
    lease.release().await;
}
