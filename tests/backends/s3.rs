//! What the S3 backend promises beyond the conformance suite, on moto's S3 server (one
//! request at a time): first that the server refuses a second create of one object
//! (an emulator that ignores preconditions would make every other check here
//! meaningless), then a crashed holder taken over one lease later, fencing tokens that
//! never go back across a released (deleted) object and across an object deleted by
//! hand, the footprint of released keys, a setup on a store that ignores conditions
//! refused, and the object names seen from S3.
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
use crate::support::moto_server::MotoServer;

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
