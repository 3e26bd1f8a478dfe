//! What the S3 backend promises beyond the conformance suite, on moto's S3 server (one
//! request at a time): first that the server refuses a second create of one object
//! (an emulator that ignores preconditions would make every other check here
//! meaningless), then a crashed holder taken over one lease later, fencing tokens that
//! never go back across a released (deleted) object and across an object deleted by
//! hand, the footprint of released keys, a setup on a store that ignores conditions
//! refused, 409 conflicts tried again (never an error), and the object names seen from
//! S3.
#![cfg(feature = "s3")]
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_s3::primitives::ByteStream;
use tokio::time::{sleep, Instant};
use tower_keyed_lock::backend::s3::S3Backend;
use tower_keyed_lock::backend::SetupError;
use tower_keyed_lock::{DistributedLocks, LockBackend};

use crate::support::fixtures::{
    self as servers, locks_on, within, Fixture, Remote, GENEROUS_TIMEOUT, PATIENCE,
};
use crate::support::moto_server::{Misbehaviour, MotoServer};

/// The fixture's lease (the TTL-lease fixtures').
const LEASE: Duration = Duration::from_secs(1);

/// How long after a grant S3's clock is surely past its token, with the fixture's
/// command timeout: two command timeouts and the clock's doubt (under a second).
const PAST_A_TOKEN: Duration =
    Duration::from_millis(2 * GENEROUS_TIMEOUT.as_millis() as u64 * 101 / 100 + 1_100);

/// The fixture's server, with its bucket made, and a backend on it.
async fn start() -> (servers::S3, S3Backend) {
    let fixture = servers::S3::start();
    let backend = servers::S3::backend_on(&fixture.0.url(), GENEROUS_TIMEOUT).await;
    (fixture, backend)
}

/// The fencing token in the object of `key` (the fixture's layer name), as S3 has it.
async fn object_fence(fixture: &servers::S3, backend: &S3Backend, key: &str) -> Option<u64> {
    let object = fixture
        .0
        .s3_client()
        .get_object()
        .bucket(servers::S3_BUCKET)
        .key(backend.object_name(servers::NAME, key))
        .send()
        .await
        .ok()?;
    let body = object.body.collect().await.ok()?.into_bytes();
    let body = String::from_utf8(body.to_vec()).ok()?;
    body.lines()
        .find_map(|line| line.strip_prefix("fence "))?
        .parse()
        .ok()
}

/// The server the other tests rest on enforces `If-None-Match: *`: a second create of
/// one object is refused with 412 Precondition Failed, and the object keeps the first
/// body. (And `If-Match` on a stale ETag is refused too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_create_of_one_object_gets_412() {
    let server = MotoServer::start();
    let client = server.s3_client();
    within(
        "creating the bucket",
        PATIENCE,
        client.create_bucket().bucket("probe").send(),
    )
    .await
    .expect("creating the bucket");
    let create = |body: &'static str| {
        client
            .put_object()
            .bucket("probe")
            .key("k")
            .if_none_match("*")
            .body(ByteStream::from_static(body.as_bytes()))
            .send()
    };
    let first = create("first").await.expect("the first create");
    let second = create("second").await;
    let status = second
        .as_ref()
        .err()
        .and_then(|error| error.raw_response())
        .map(|raw| raw.status().as_u16());
    assert_eq!(
        status,
        Some(412),
        "a second create must get 412 Precondition Failed: {second:?}"
    );
    let read = client
        .get_object()
        .bucket("probe")
        .key("k")
        .send()
        .await
        .unwrap();
    assert_eq!(read.e_tag(), first.e_tag(), "the first body stays");
    let stale = client
        .put_object()
        .bucket("probe")
        .key("k")
        .if_match("\"0123456789abcdef0123456789abcdef\"")
        .body(ByteStream::from_static(b"third"))
        .send()
        .await;
    let status = stale
        .as_ref()
        .err()
        .and_then(|error| error.raw_response())
        .map(|raw| raw.status().as_u16());
    assert_eq!(status, Some(412), "a write on a stale ETag: {stale:?}");
}

/// The object is the record: while a key is held its object carries the holder's
/// token, and each grant, by another instance too, writes a higher one. (Exclusion
/// and token order across instances are the conformance suite's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_object_carries_each_holders_token() {
    let (fixture, backend) = start().await;
    let mut last = 0;
    for name in ["a", "b", "a"] {
        let locks = fixture.instance(name).await;
        let guard = locks.lock_timeout("counter", PATIENCE).await.unwrap();
        let token = guard.fencing_token().expect("S3 issues fencing tokens");
        assert!(token > last, "token {token} after {last}");
        let stored = object_fence(&fixture, &backend, "counter").await;
        assert_eq!(stored, Some(token), "the held object's token");
        last = token;
        guard.release().await;
    }
}

/// The holder's process dies without releasing (its runtime dropped, no renewal): its
/// object stays, named as held, until another instance has seen it unchanged for a
/// lease on its own clock, then that instance takes it over with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_holder_is_taken_over_one_lease_after_it_was_seen() {
    let (fixture, _backend) = start().await;
    let backend = fixture.backend_named("crashed").await;
    let (granted, crashed_token) = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        let granted = runtime.block_on(async {
            let sent = Instant::now();
            let guard = locks_on(backend).lock("crash").await.unwrap();
            let token = guard.fencing_token().unwrap();
            std::mem::forget(guard);
            (sent, token)
        });
        // The crash: every task of the holder (its renewal) stops here.
        drop(runtime);
        granted
    })
    .join()
    .unwrap();
    let other = fixture.instance("other").await;
    let holder = other.holder("crash").await.unwrap();
    assert_eq!(
        holder.and_then(|holder| holder.fencing_token()),
        Some(crashed_token),
        "the crashed holder is still named"
    );
    let seen = Instant::now();
    let taken = within(
        "the takeover of a crashed holder's object",
        LEASE + PATIENCE,
        other.lock_timeout("crash", LEASE + PATIENCE),
    )
    .await
    .expect("the crashed holder's object is taken over one lease later");
    let (after_grant, after_seen) = (granted.elapsed(), seen.elapsed());
    eprintln!("crashed holder: taken over {after_seen:?} after it was seen held");
    assert!(
        after_seen >= LEASE,
        "taken over {after_seen:?} after it was first seen, within the holder's lease {LEASE:?}"
    );
    assert!(
        after_grant < LEASE + PATIENCE,
        "taken over only {after_grant:?} after the crash"
    );
    assert!(taken.fencing_token().unwrap() > crashed_token);
    taken.release().await;
}

/// A holder that renews is never taken over, however long it holds: every renewal
/// writes a new ETag, so a waiter's lease-long watch starts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewing_holder_is_never_taken_over() {
    let (fixture, _backend) = start().await;
    let holder = fixture.instance("holder").await;
    let other = fixture.instance("other").await;
    let guard = holder.lock("kept").await.unwrap();
    let waited = other.lock_timeout("kept", 3 * LEASE).await;
    assert!(
        matches!(waited, Err(tower_keyed_lock::LockError::Timeout)),
        "a renewing holder's key was taken or failed: {waited:?}"
    );
    assert!(!guard.is_lost(), "the renewing holder lost its lease");
    let token = guard.fencing_token().unwrap();
    guard.release().await;
    let next = within(
        "the released key",
        PATIENCE,
        other.lock_timeout("kept", PATIENCE),
    )
    .await
    .unwrap();
    assert!(next.fencing_token().unwrap() > token);
    next.release().await;
}

/// Fencing tokens never go back for a key, whatever happened to its object: released
/// late enough to be deleted at once, released early (written free, deleted later), or
/// deleted by hand; each next grant comes from a backend built anew (nothing
/// remembered in process), so only S3's clock keeps the tokens going up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_never_go_back_across_deleted_objects() {
    let (fixture, backend) = start().await;
    let fresh = || async {
        let backend = servers::S3::backend_on(&fixture.0.url(), GENEROUS_TIMEOUT).await;
        locks_on(Arc::new(backend))
    };
    let key = "fenced";
    let prefix = backend.object_name(servers::NAME, "");
    let prefix = prefix.trim_end_matches(|c| c != '/');

    // Held past S3's clock: the release deletes the object at once.
    let first = fresh().await.lock(key).await.unwrap();
    let t1 = first.fencing_token().unwrap();
    sleep(PAST_A_TOKEN).await;
    first.release().await;
    assert_eq!(
        fixture.objects(prefix).await,
        0,
        "the released object stays"
    );

    // Released at once: written free, and a grant before the delete counts on.
    let second = fresh().await.lock(key).await.unwrap();
    let t2 = second.fencing_token().unwrap();
    assert!(t2 > t1, "{t2} after {t1}, across a deleted object");
    second.release().await;
    assert_eq!(object_fence(&fixture, &backend, key).await, Some(t2));
    let third = fresh().await.lock(key).await.unwrap();
    let t3 = third.fencing_token().unwrap();
    assert_eq!(t3, t2 + 1, "a grant on a free object counts on");
    third.release().await;
    // …then the object goes within the record window.
    let window = tower_keyed_lock::backend::s3::record_window(GENEROUS_TIMEOUT);
    let gone_by = Instant::now() + window;
    while fixture.objects(prefix).await > 0 {
        assert!(
            Instant::now() < gone_by,
            "the released object outlived {window:?}"
        );
        sleep(Duration::from_millis(100)).await;
    }
    let fourth = fresh().await.lock(key).await.unwrap();
    let t4 = fourth.fencing_token().unwrap();
    assert!(t4 > t3, "{t4} after {t3}, across an object deleted later");

    // Deleted by hand while held, past S3's clock: the holder is told at its next
    // renewal, and the next object's tokens start above.
    sleep(PAST_A_TOKEN).await;
    fixture
        .0
        .s3_client()
        .delete_object()
        .bucket(servers::S3_BUCKET)
        .key(backend.object_name(servers::NAME, key))
        .send()
        .await
        .unwrap();
    within("the holder is told", PATIENCE, fourth.lost()).await;
    let fifth = fresh().await.lock(key).await.unwrap();
    let t5 = fifth.fencing_token().unwrap();
    assert!(t5 > t4, "{t5} after {t4}, across an object deleted by hand");
    fifth.release().await;
    drop(fourth);
}

/// A store that ignores `If-None-Match` and `If-Match` is refused when the backend is
/// built, by name, and leaves no probe object behind; so is a bucket that does not
/// exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_that_ignores_conditions_or_a_missing_bucket_is_refused() {
    let server = MotoServer::misbehaving(Misbehaviour::IgnorePreconditions);
    let client = server.s3_client();
    within(
        "creating the bucket",
        PATIENCE,
        client.create_bucket().bucket("locks").send(),
    )
    .await
    .expect("creating the bucket");
    let built = S3Backend::builder(client.clone(), "locks").build().await;
    match built {
        Err(SetupError::Unsafe(why)) => assert!(why.contains("If-None-Match"), "{why}"),
        other => panic!("a store ignoring conditions was not refused: {other:?}"),
    }
    let left = client
        .list_objects_v2()
        .bucket("locks")
        .send()
        .await
        .unwrap();
    assert_eq!(left.contents().len(), 0, "the probe object stays");

    let built = S3Backend::builder(client, "no-such-bucket").build().await;
    match built {
        Err(error @ SetupError::Failed { .. }) => {
            assert!(error.to_string().contains("S3"), "{error}")
        }
        other => panic!("a missing bucket was not refused: {other:?}"),
    }
}

/// The object of a held key is where [`S3Backend::object_name`] says, names its holder
/// and token, and the backend's `holder` reads the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_object_is_where_its_name_says_and_names_the_holder() {
    let (fixture, backend) = start().await;
    let locks = DistributedLocks::new(servers::NAME, backend.clone());
    let guard = locks.lock("a/b c").await.unwrap();
    let name = backend.object_name(servers::NAME, "a/b c");
    assert_eq!(name, format!("keyed-lock/{}/a%2Fb%20c", servers::NAME));
    let token = guard.fencing_token().unwrap();
    assert_eq!(object_fence(&fixture, &backend, "a/b c").await, Some(token));
    let key = tower_keyed_lock::Key::new("a/b c", 256).unwrap();
    let holder = backend
        .holder(servers::NAME, &key)
        .await
        .unwrap()
        .expect("held");
    assert_eq!(holder.fencing_token(), Some(token));
    assert_eq!(
        holder.instance(),
        Some(tower_keyed_lock::backend::default_instance_id().as_str())
    );
    guard.release().await;
    assert!(backend.holder(servers::NAME, &key).await.unwrap().is_none());
}

/// S3 answers 409 (`ConditionalRequestConflict`) when conditional writes on one object
/// race; like 412, it means "not granted, try again": with every third conditional
/// write or delete answered so, two instances taking one key in turn still get it
/// every time within the wait, one at a time, with tokens in holding order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conflicts_409_are_tried_again_never_errors() {
    let fixture = servers::S3(MotoServer::misbehaving(Misbehaviour::ConflictEvery(3)));
    let inside = Arc::new(AtomicU64::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut instances = Vec::new();
    for name in ["a", "b"] {
        let locks = fixture.instance(name).await;
        let (inside, tokens) = (inside.clone(), tokens.clone());
        instances.push(tokio::spawn(async move {
            for round in 0..10 {
                let guard = locks
                    .lock_timeout("contended", PATIENCE)
                    .await
                    .unwrap_or_else(|error| panic!("{name}, round {round}: {error}"));
                assert_eq!(inside.fetch_add(1, SeqCst), 0, "two holders at once");
                tokens.lock().unwrap().push(guard.fencing_token().unwrap());
                sleep(Duration::from_millis(5)).await;
                inside.fetch_sub(1, SeqCst);
                guard.release().await;
            }
        }));
    }
    for instance in instances {
        within("an instance's rounds", 4 * PATIENCE, instance)
            .await
            .unwrap();
    }
    let tokens = tokens.lock().unwrap().clone();
    assert_eq!(tokens.len(), 20);
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens out of holding order: {tokens:?}"
    );
}
