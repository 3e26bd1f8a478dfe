//! The S3 backend against moto's S3 server (from PyPI, one request at a time) started on
//! a free port, and the hand-off between two instances.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench s3
//! cargo bench -p tower-keyed-lock-benches --bench s3 -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release of one key: `S3Backend` (`acquire` then
//!    `Lease::release`: read the object, write the grant on a condition, write it free
//!    or delete it on a condition) against the bare conditional calls on another object
//!    with the same SDK: a create with `If-None-Match: *`, then a delete with `If-Match`
//!    on its ETag (the least a lock on conditional writes can do). Criterion times each;
//!    then both run in alternating batches (A B, B A, …) and the median ratio is
//!    printed.
//! 2. Hand-off between two instances: instance A holds the key, instance B waits for it
//!    (polling: S3 has no notification), A releases; the time from the start of A's
//!    release to B's grant, with the default poll interval (500 ms) and with 50 ms.
//!
//! moto is a Python process on this machine: the figures are round trips to it, not to
//! S3 (tens of milliseconds per conditional write from a region's own network).

#[path = "../tests/support/moto_server.rs"]
mod moto_server;
mod support;
use support::process;

use std::sync::Arc;
use std::time::Duration;

use support::engine::{hand_off, report_hand_off, EngineBench};

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;
use tower_keyed_lock::backend::s3::{S3Backend, DEFAULT_POLL_INTERVAL};
use tower_keyed_lock::{Key, LockBackend};

const BUCKET: &str = "bench";
const LEASE: Duration = Duration::from_secs(10);

/// Long enough for the waiter to have polled a few times and reached its longest pause.
const SETTLE: Duration = Duration::from_millis(1000);

fn main() {
    let mut bench = EngineBench::new();
    let server = moto_server::MotoServer::start();
    let url = server.url();
    let client = s3_client(&url);
    bench.rt.block_on(async {
        client
            .create_bucket()
            .bucket(BUCKET)
            .send()
            .await
            .expect("creating the bucket")
    });
    let backend = bench.rt.block_on(s3_backend(&url, DEFAULT_POLL_INTERVAL));
    let key = Key::new("order-1", 256).unwrap();
    bench.uncontended(
        "s3",
        || backend_round(&backend, &key),
        ("bare-create-delete", "conditional create + delete", || {
            bare_round(&client)
        }),
        50,
    );

    let (rt, handoffs) = (&bench.rt, if bench.quick { 3 } else { 30 });
    for poll in [DEFAULT_POLL_INTERVAL, Duration::from_millis(50)] {
        let (a, b) = rt.block_on(async {
            let a: Arc<dyn LockBackend> = Arc::new(s3_backend(&url, poll).await);
            let b: Arc<dyn LockBackend> = Arc::new(s3_backend(&url, poll).await);
            (a, b)
        });
        let times = rt.block_on(hand_off(a, b, handoffs, SETTLE));
        report_hand_off(&format!("s3 (moto), poll interval {poll:?}"), &times);
    }
    bench.finish();
}

async fn s3_backend(url: &str, poll: Duration) -> S3Backend {
    S3Backend::builder(s3_client(url), BUCKET)
        .lease(LEASE)
        .poll_interval(poll)
        .build()
        .await
        .expect("the backend reaches moto's S3")
}

/// A client of moto's S3 at `url`: path-style (the bucket in the path, as moto serves
/// it on an address), static fake credentials.
fn s3_client(url: &str) -> Client {
    use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .force_path_style(true)
        .credentials_provider(Credentials::new("test", "test", None, None, "static"))
        .build();
    Client::from_conf(config)
}

async fn backend_round(backend: &S3Backend, key: &Key) {
    let lease = backend
        .acquire("bench", key, Duration::from_secs(1))
        .await
        .expect("an uncontended key");
    lease.release().await;
}

/// The conditional calls alone: create the object if absent, delete it if unchanged.
async fn bare_round(client: &Client) {
    let created = client
        .put_object()
        .bucket(BUCKET)
        .key("bare/order-1")
        .if_none_match("*")
        .body(ByteStream::from_static(b"held"))
        .send()
        .await
        .expect("an absent object");
    client
        .delete_object()
        .bucket(BUCKET)
        .key("bare/order-1")
        .if_match(created.e_tag().expect("an ETag"))
        .send()
        .await
        .expect("our object");
}
