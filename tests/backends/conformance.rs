//! The backend conformance suite (`tower_keyed_lock::testkit`), run for every backend
//! against real servers — Redis, a Redis Cluster, PostgreSQL (also through PgBouncer),
//! DynamoDB (moto), etcd, MariaDB, Redlock's five Redis masters, Azure Blob Storage
//! (Azurite), S3 (moto), ZooKeeper — and for a backend written outside the crate, as a user would
//! write one.
#![cfg(feature = "testkit")]
#![cfg_attr(
    not(any(
        feature = "redis",
        feature = "postgres",
        feature = "dynamodb",
        feature = "etcd",
        feature = "mysql",
        feature = "azure-blob",
        feature = "zookeeper",
        feature = "s3"
    )),
    allow(dead_code)
)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::time::{sleep, sleep_until, Instant};
use tower_keyed_lock::backend::{
    default_instance_id, Acquisition, BoxFuture, Holder, LeaseLostSender, LostReason, ReleaseLease,
};
use tower_keyed_lock::testkit::Deployment;
#[cfg(feature = "axum")]
use tower_keyed_lock::testkit::PATIENCE;
use tower_keyed_lock::{Key, Lease, LeaseSignal, LockBackend, LockError};

/// Shows the figures the checks log (hand-over and takeover times) with
/// `--nocapture`.
fn show_figures() {
    let subscriber = tracing_subscriber::fmt()
        .with_test_writer()
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// `conformance!(fixture_module, Fixture, "feature")`: one test per check, run on the
/// fixture itself (a testkit `Deployment`), on the server the checks running at once
/// share ([`shared`](crate::support::fixtures::shared)), each under names of its own;
/// the footprint check counts every record on its server, so it runs on one of its own.
macro_rules! conformance {
    ($module:ident, $fixture:ty, $feature:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            conformance!(@checks $fixture;
                one_holder_at_a_time,
                busy_and_timeout,
                release_hands_over,
                fencing_tokens_increase,
                dropped_acquisitions_leave_nothing_held,
                a_stalled_holder_sees_its_lease_lost,
                a_crashed_holder_is_taken_over,
                a_released_lease_is_never_renewed,
                renewal_keeps_a_key_held_past_several_leases,
                several_keys_all_or_nothing,
                health_answers,
                the_deployment_live_run_passes,
                contention_is_reported,
                a_key_held_on_another_instance_times_out_with_409,
                a_client_that_disconnects_while_holding_leaves_no_key,
                clients_that_disconnect_while_waiting_leave_no_key,
            );
        }
    };
    // Some of the checks, for the engines that meet them: `modes!`, `holder!`; and
    // `footprint!`, on a server of its own (`alone`).
    (@only $($alone:ident)? [$($check:ident),* $(,)?] $module:ident, $fixture:ty, $feature:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            conformance!(@checks $($alone)? $fixture; $($check),*);
        }
    };
    (@checks alone $fixture:ty; $($check:ident),* $(,)?) => {
        conformance!(@checks_on (std::sync::Arc::new(<$fixture as crate::support::fixtures::Fixture>::start())); $($check),*);
    };
    (@checks $fixture:ty; $($check:ident),* $(,)?) => {
        conformance!(@checks_on (crate::support::fixtures::shared::<$fixture>()); $($check),*);
    };
    (@checks_on ($start:expr); $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                crate::conformance::show_figures();
                let fixture = $start;
                tower_keyed_lock::testkit::$check(&*fixture).await;
            }
        )*
    };
}

conformance!(redis, crate::support::fixtures::Redis, "redis");
conformance!(
    redis_cluster,
    crate::support::fixtures::RedisCluster,
    "redis"
);

/// `modes!(fixture_module, Fixture, "feature")`: the shared and permit checks, for the
/// engines that hold a key in those modes.
macro_rules! modes {
    ($($engine:tt)*) => {
        conformance!(@only [
            readers_hold_together,
            a_writer_excludes_everyone,
            a_waiting_writer_is_not_starved,
            at_most_n_permit_holders,
            a_crashed_permit_comes_back,
            fencing_tokens_across_modes,
            dropped_shared_and_permit_acquisitions_leave_nothing_held,
            exclusive_and_permits_exclude_each_other,
        ] $($engine)*);
    };
}

mod modes {
    modes!(redis, crate::support::fixtures::Redis, "redis");
    modes!(
        redis_cluster,
        crate::support::fixtures::RedisCluster,
        "redis"
    );
    modes!(postgres, crate::support::fixtures::Postgres, "postgres");
}
conformance!(postgres, crate::support::fixtures::Postgres, "postgres");
conformance!(
    pgbouncer_transaction,
    crate::support::fixtures::PgBouncerTransaction,
    "postgres"
);
conformance!(dynamodb, crate::support::fixtures::DynamoDb, "dynamodb");
conformance!(s3, crate::support::fixtures::S3, "s3");
conformance!(etcd, crate::support::fixtures::Etcd, "etcd");
conformance!(mysql, crate::support::fixtures::MySql, "mysql");
conformance!(redlock, crate::support::fixtures::Redlock, "redis");
conformance!(
    azure_blob,
    crate::support::fixtures::AzureBlob,
    "azure-blob"
);
conformance!(zookeeper, crate::support::fixtures::ZooKeeper, "zookeeper");

/// `footprint!(fixture_module, Fixture, "feature")`: what a released key leaves on the
/// server, counted on a server of its own.
macro_rules! footprint {
    ($($engine:tt)*) => {
        conformance!(@only alone [released_keys_leave_no_records] $($engine)*);
    };
}

mod footprint {
    footprint!(redis, crate::support::fixtures::Redis, "redis");
    footprint!(
        redis_cluster,
        crate::support::fixtures::RedisCluster,
        "redis"
    );
    footprint!(postgres, crate::support::fixtures::Postgres, "postgres");
    footprint!(
        pgbouncer_transaction,
        crate::support::fixtures::PgBouncerTransaction,
        "postgres"
    );
    footprint!(etcd, crate::support::fixtures::Etcd, "etcd");
    footprint!(mysql, crate::support::fixtures::MySql, "mysql");
    footprint!(zookeeper, crate::support::fixtures::ZooKeeper, "zookeeper");
    footprint!(redlock, crate::support::fixtures::Redlock, "redis");
    footprint!(dynamodb, crate::support::fixtures::DynamoDb, "dynamodb");
    footprint!(s3, crate::support::fixtures::S3, "s3");
    footprint!(
        azure_blob,
        crate::support::fixtures::AzureBlob,
        "azure-blob"
    );
}

/// `holder!(fixture_module, Fixture, "feature")`: the inspection check, for the
/// engines that can tell who holds a key (RELIABILITY.md marks the others).
macro_rules! holder {
    ($($engine:tt)*) => {
        conformance!(@only [the_holder_is_read_without_taking_the_key] $($engine)*);
    };
}

mod inspect {
    holder!(redis, crate::support::fixtures::Redis, "redis");
    holder!(
        redis_cluster,
        crate::support::fixtures::RedisCluster,
        "redis"
    );
    holder!(postgres, crate::support::fixtures::Postgres, "postgres");
    holder!(
        pgbouncer_transaction,
        crate::support::fixtures::PgBouncerTransaction,
        "postgres"
    );
    holder!(dynamodb, crate::support::fixtures::DynamoDb, "dynamodb");
    holder!(s3, crate::support::fixtures::S3, "s3");
    holder!(zookeeper, crate::support::fixtures::ZooKeeper, "zookeeper");
    holder!(etcd, crate::support::fixtures::Etcd, "etcd");
    holder!(redlock, crate::support::fixtures::Redlock, "redis");
    holder!(
        azure_blob,
        crate::support::fixtures::AzureBlob,
        "azure-blob"
    );
}

// ------------------------------------------------------------ faults through the proxy

/// `faults!(fixture_module, Fixture, "feature")`: the fault checks of a fixture whose
/// instances can reach the server through the TCP proxy.
/// Checks named in brackets after the feature run too.
macro_rules! faults {
    ($module:ident, $fixture:ty, $feature:literal $(, [$($also:ident),* $(,)?])?) => {
        #[cfg(feature = $feature)]
        mod $module {
            faults!(@checks $fixture;
                a_cut_off_holder_is_told_before_another_instance_is_granted,
                no_acquisition_outlives_its_wait_on_a_silent_path,
                a_slow_path_keeps_the_lease,
                a_reset_connection_is_a_lost_lease_and_recovers,
                the_health_check_fails_on_a_silent_path_and_recovers,
                an_outage_that_heals_within_the_wait_is_ridden_out,
                abort_on_lease_lost_answers_503,
                $($($also,)*)?
            );
        }
    };
    (@checks $fixture:ty; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                crate::conformance::show_figures();
                let fixture = <$fixture as crate::support::fixtures::Fixture>::start();
                tower_keyed_lock::testkit::$check(&fixture).await;
            }
        )*
    };
}

// `a_dropped_path_does_not_end_a_wait` runs on the engines whose waits retry a broken
// connection or an unanswered command within the wait (etcd, MySQL, Azure Blob,
// ZooKeeper, Redis, DynamoDB, S3, PostgreSQL): all of them.
mod faults {
    faults!(
        redis,
        crate::support::fixtures::Redis,
        "redis",
        [a_dropped_path_does_not_end_a_wait]
    );
    faults!(
        postgres,
        crate::support::fixtures::Postgres,
        "postgres",
        [a_dropped_path_does_not_end_a_wait]
    );
    faults!(
        dynamodb,
        crate::support::fixtures::DynamoDb,
        "dynamodb",
        [a_dropped_path_does_not_end_a_wait]
    );
    faults!(
        s3,
        crate::support::fixtures::S3,
        "s3",
        [a_dropped_path_does_not_end_a_wait]
    );
    faults!(
        etcd,
        crate::support::fixtures::Etcd,
        "etcd",
        [a_dropped_path_does_not_end_a_wait]
    );
    faults!(
        mysql,
        crate::support::fixtures::MySql,
        "mysql",
        [a_dropped_path_does_not_end_a_wait]
    );
    faults!(
        azure_blob,
        crate::support::fixtures::AzureBlob,
        "azure-blob",
        [a_dropped_path_does_not_end_a_wait]
    );
    faults!(
        zookeeper,
        crate::support::fixtures::ZooKeeper,
        "zookeeper",
        [a_dropped_path_does_not_end_a_wait]
    );
}

// ------------------------------------------------------------- through the layer

/// `through_the_layer!(fixture_module, Fixture, "feature")`: on a server the tests
/// running at once share, each in a scope of its own.
#[cfg(feature = "axum")]
macro_rules! through_the_layer {
    ($module:ident, $fixture:ty, $feature:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn one_handler_at_a_time_across_instances_over_http() {
                let fixture = <crate::support::fixtures::Scoped<$fixture> as crate::support::fixtures::Fixture>::start();
                crate::conformance::one_handler_at_a_time_across_instances_over_http(&fixture)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn different_keys_run_in_parallel_across_instances_over_http() {
                let fixture = <crate::support::fixtures::Scoped<$fixture> as crate::support::fixtures::Fixture>::start();
                crate::conformance::different_keys_run_in_parallel_across_instances_over_http(
                    &fixture,
                )
                .await;
            }
        }
    };
}

#[cfg(feature = "axum")]
mod through_the_layer {
    through_the_layer!(redis, crate::support::fixtures::Redis, "redis");
    through_the_layer!(
        redis_cluster,
        crate::support::fixtures::RedisCluster,
        "redis"
    );
    through_the_layer!(postgres, crate::support::fixtures::Postgres, "postgres");
    through_the_layer!(
        pgbouncer_transaction,
        crate::support::fixtures::PgBouncerTransaction,
        "postgres"
    );
    through_the_layer!(dynamodb, crate::support::fixtures::DynamoDb, "dynamodb");
    through_the_layer!(s3, crate::support::fixtures::S3, "s3");
    through_the_layer!(etcd, crate::support::fixtures::Etcd, "etcd");
    through_the_layer!(mysql, crate::support::fixtures::MySql, "mysql");
    through_the_layer!(redlock, crate::support::fixtures::Redlock, "redis");
    through_the_layer!(
        azure_blob,
        crate::support::fixtures::AzureBlob,
        "azure-blob"
    );
    through_the_layer!(zookeeper, crate::support::fixtures::ZooKeeper, "zookeeper");
}

/// Two instances of an axum app, each with its own backend, take 40 requests for one
/// order at once: their handlers never overlap, every request is answered 200, and the
/// fencing tokens the handlers see grow in the order they ran.
#[cfg(feature = "axum")]
async fn one_handler_at_a_time_across_instances_over_http<F: crate::support::fixtures::Remote>(
    fixture: &F,
) {
    use crate::support::Overlap;
    use axum::extract::Extension;
    use axum::routing::post;
    use tower_keyed_lock::{KeyedLockLayer, LockInfo};

    let overlap = Arc::new(Overlap::default());
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let mut servers = Vec::new();
    for name in ["a", "b"] {
        let (overlap, tokens) = (overlap.clone(), tokens.clone());
        let handler = move |Extension(lock): Extension<LockInfo>| async move {
            let _inside = overlap.enter();
            tokens.lock().unwrap().push(lock.fencing_token());
            tokio::time::sleep(Duration::from_millis(2)).await;
            "paid"
        };
        let app = axum::Router::new()
            .route("/orders/{id}/pay", post(handler))
            .layer(
                KeyedLockLayer::by_path("id")
                    .name("conformance-http")
                    .wait_timeout(PATIENCE)
                    .backend(fixture.backend_named(name).await),
            );
        servers.push(Arc::new(crate::support::serve(app).await));
    }
    let requests = (0..40).map(|n| {
        let server = servers[n % 2].clone();
        async move { server.post("/orders/7/pay").await.status }
    });
    let statuses = crate::support::join_all(requests).await;
    // Every request is answered: run (200), or refused because a backend command
    // outlived its timeout on a loaded machine (503) — never a wrong answer.
    let ran = statuses
        .iter()
        .filter(|status| **status == http::StatusCode::OK)
        .count();
    let answers = [http::StatusCode::OK, http::StatusCode::SERVICE_UNAVAILABLE];
    assert!(
        statuses.iter().all(|status| answers.contains(status)),
        "{statuses:?}"
    );
    assert!(ran > 0, "{statuses:?}");
    assert_eq!(overlap.max(), 1, "two handlers of one key ran at once");
    let tokens = tokens.lock().unwrap().clone();
    assert_eq!(tokens.len(), ran);
    if tokens.iter().any(Option::is_some) {
        let tokens: Vec<u64> = tokens.into_iter().map(Option::unwrap).collect();
        assert!(
            tokens.windows(2).all(|pair| pair[0] < pair[1]),
            "fencing tokens out of order: {tokens:?}"
        );
    }
}

/// Four requests for four keys, two on each instance: every handler waits until all
/// four are inside, so they only finish if the keys run in parallel across instances.
#[cfg(feature = "axum")]
async fn different_keys_run_in_parallel_across_instances_over_http<
    F: crate::support::fixtures::Remote,
>(
    fixture: &F,
) {
    use axum::routing::post;
    use http::StatusCode;
    use tower_keyed_lock::KeyedLockLayer;

    let barrier = Arc::new(tokio::sync::Barrier::new(4));
    let mut servers = Vec::new();
    for name in ["a", "b"] {
        let barrier = barrier.clone();
        let handler = move || {
            let barrier = barrier.clone();
            async move {
                match tokio::time::timeout(PATIENCE, barrier.wait()).await {
                    Ok(_) => StatusCode::OK,
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                }
            }
        };
        let app = axum::Router::new()
            .route("/orders/{id}/pay", post(handler))
            .layer(
                KeyedLockLayer::by_path("id")
                    .name("conformance-parallel")
                    .wait_timeout(PATIENCE)
                    .backend(fixture.backend_named(name).await),
            );
        servers.push(Arc::new(crate::support::serve(app).await));
    }
    let requests = (1..=4).map(|key| {
        let server = servers[key % 2].clone();
        async move { server.post(&format!("/orders/{key}/pay")).await.status }
    });
    let statuses = crate::support::join_all(requests).await;
    assert!(
        statuses.iter().all(|status| *status == StatusCode::OK),
        "different keys did not all run at once: {statuses:?}"
    );
}

// ------------------------------------------------- a backend written outside the crate

/// A lock service of its own, as a user might write one over their engine: a shared
/// table of holders with expiries, one fencing counter for every key, and leases
/// renewed at a third.
#[derive(Clone, Default)]
struct TableService(Arc<Mutex<Table>>);

#[derive(Default)]
struct Table {
    /// The keys held now: the only records kept per key.
    holders: HashMap<String, Held>,
    /// The last fencing token granted, on any key: one counter keeps tokens going up
    /// for every key without a record per key released.
    fence: u64,
    next_owner: u64,
}

struct Held {
    owner: u64,
    expires: Instant,
    fence: u64,
    /// When the holder was granted the key.
    granted: SystemTime,
}

const LEASE: Duration = Duration::from_millis(600);

/// One instance's client of the [`TableService`].
struct TableBackend(TableService);

impl TableService {
    /// Grants `key` to a new owner if free or expired: `(owner, fence)`.
    fn try_grant(&self, key: &str, now: Instant) -> Option<(u64, u64)> {
        let mut table = self.0.lock().unwrap();
        if table
            .holders
            .get(key)
            .is_some_and(|held| now < held.expires)
        {
            return None;
        }
        table.next_owner += 1;
        table.fence += 1;
        let (owner, fence) = (table.next_owner, table.fence);
        let held = Held {
            owner,
            expires: now + LEASE,
            fence,
            granted: SystemTime::now(),
        };
        table.holders.insert(key.to_owned(), held);
        Some((owner, fence))
    }

    fn renew(&self, key: &str, owner: u64, now: Instant) -> bool {
        let mut table = self.0.lock().unwrap();
        match table.holders.get_mut(key) {
            Some(held) if held.owner == owner && now < held.expires => {
                held.expires = now + LEASE;
                true
            }
            _ => false,
        }
    }

    /// Who holds `key` now, if anyone (every instance of this test is one process).
    fn holder(&self, key: &str, now: Instant) -> Option<Holder> {
        let table = self.0.lock().unwrap();
        let held = table.holders.get(key).filter(|held| now < held.expires)?;
        Some(
            Holder::new()
                .with_instance(default_instance_id())
                .with_since(held.granted)
                .with_fencing_token(held.fence)
                .with_lease_left(held.expires - now),
        )
    }

    fn release(&self, key: &str, owner: u64) {
        let mut table = self.0.lock().unwrap();
        if table
            .holders
            .get(key)
            .is_some_and(|held| held.owner == owner)
        {
            table.holders.remove(key);
        }
    }

    /// The records kept for the lock name `name`: its keys' holders (an expired holder
    /// stays until the key is taken again, as a crashed holder's would) and the one
    /// fencing counter.
    fn records(&self, name: &str) -> usize {
        let table = self.0.lock().unwrap();
        let prefix = format!("{name}:");
        let holders = table
            .holders
            .keys()
            .filter(|key| key.starts_with(&prefix))
            .count();
        holders + 1
    }
}

impl LockBackend for TableBackend {
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let service = self.0.clone();
        let key = format!("{name}:{}", key.as_str());
        Box::pin(async move {
            let deadline = Instant::now() + wait;
            let mut first = true;
            loop {
                let sent = Instant::now();
                if let Some((owner, fence)) = service.try_grant(&key, sent) {
                    let (lost, signal) = LeaseSignal::with_deadline(sent + LEASE);
                    let renewal = tokio::spawn(keep(service.clone(), key.clone(), owner, lost));
                    let release = TableRelease {
                        service,
                        key,
                        owner,
                        renewal,
                    };
                    let lease = Lease::new(Some(fence), signal, release);
                    return Ok(lease.with_contention(!first));
                }
                first = false;
                if Instant::now() >= deadline {
                    return Err(LockError::Timeout);
                }
                sleep(Duration::from_millis(5).min(deadline - Instant::now())).await;
            }
        })
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let holder = self
            .0
            .holder(&format!("{name}:{}", key.as_str()), Instant::now());
        Box::pin(async move { Ok(holder) })
    }
}

async fn keep(service: TableService, key: String, owner: u64, lost: LeaseLostSender) {
    let mut sent = Instant::now();
    loop {
        sleep_until(sent + LEASE / 3).await;
        sent = Instant::now();
        if !service.renew(&key, owner, sent) {
            lost.lose(LostReason::NotOwner);
            return;
        }
        if !lost.extend(sent + LEASE) {
            return; // lost: the deadline had passed
        }
    }
}

struct TableRelease {
    service: TableService,
    key: String,
    owner: u64,
    renewal: tokio::task::JoinHandle<()>,
}

impl ReleaseLease for TableRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        self.renewal.abort();
        self.service.release(&self.key, self.owner);
        Box::pin(async {})
    }
}

impl Drop for TableRelease {
    fn drop(&mut self) {
        self.renewal.abort();
    }
}

struct TableDeployment(TableService);

impl Deployment for TableDeployment {
    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(TableBackend(self.0.clone()))
    }

    fn loss_bound(&self) -> Duration {
        LEASE
    }

    async fn records(&self, name: &str) -> usize {
        self.0.records(name)
    }

    /// A release removes the holder at once.
    fn record_window(&self) -> Duration {
        Duration::ZERO
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backend_written_outside_the_crate_conforms() {
    tower_keyed_lock::testkit::run_all(&TableDeployment(TableService::default())).await;
}

// ------------------------------------------------------------ the in-memory engine

/// The lease of the in-memory engine here: long enough for a loaded machine's task
/// switches, short enough for the checks that wait one out.
const MEMORY_LEASE: Duration = Duration::from_millis(600);

/// The crate's in-memory engine (`testkit::MemoryBackend`): every instance a clone.
struct MemoryDeployment(tower_keyed_lock::testkit::MemoryBackend);

impl Deployment for MemoryDeployment {
    async fn backend(&self) -> Arc<dyn LockBackend> {
        Arc::new(self.0.clone())
    }

    fn loss_bound(&self) -> Duration {
        MEMORY_LEASE
    }

    async fn records(&self, name: &str) -> usize {
        self.0.records(name)
    }

    /// A release removes the key's record at once.
    fn record_window(&self) -> Duration {
        Duration::ZERO
    }
}

fn memory() -> MemoryDeployment {
    MemoryDeployment(tower_keyed_lock::testkit::MemoryBackend::new().with_lease(MEMORY_LEASE))
}

/// Every engine check and every mode check, as any engine runs them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_memory_backend_conforms() {
    let deployment = memory();
    tower_keyed_lock::testkit::run_all(&deployment).await;
    tower_keyed_lock::testkit::run_modes(&deployment).await;
}

/// `lose` takes a key from its holder as an engine would: the holder is told at once
/// (not owner), `run_while_held` refuses, a checked release reports it, and another
/// instance gets the key at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_memory_backend_loses_a_lease_on_demand() {
    use tower_keyed_lock::DistributedLocks;
    let engine = tower_keyed_lock::testkit::MemoryBackend::new();
    let a = DistributedLocks::new("jobs", engine.clone());
    let b = DistributedLocks::new("jobs", engine.clone());
    let guard = a.lock("nightly").await.unwrap();
    assert!(!guard.is_lost());
    assert!(!engine.lose("jobs", "someone-else's"));
    assert!(engine.lose("jobs", "nightly"));
    assert!(guard.is_lost());
    assert_eq!(guard.lost_reason(), Some(LostReason::NotOwner));
    let refused = guard.run_while_held(async {}).await;
    assert_eq!(
        refused.map_err(|lost| lost.reason()),
        Err(LostReason::NotOwner)
    );
    let taken = b.try_lock("nightly").await.expect("free once lost");
    assert_eq!(
        guard.release_checked().await.map_err(|lost| lost.reason()),
        Err(LostReason::NotOwner),
        "a checked release of a lost lease says so"
    );
    assert!(taken.fencing_token().is_some());
    taken.release().await;
    assert_eq!(engine.records("jobs"), 0);
}

// ------------------------------------------------------ RELIABILITY.md, checked

/// The columns of RELIABILITY.md's conformance table, as the fixture modules here.
// Read only by the check below, built with every engine.
#[cfg_attr(
    not(all(
        feature = "redis",
        feature = "postgres",
        feature = "dynamodb",
        feature = "etcd",
        feature = "mysql",
        feature = "azure-blob",
        feature = "zookeeper",
        feature = "s3",
        feature = "axum"
    )),
    allow(dead_code)
)]
const COLUMNS: [(&str, &str); 12] = [
    ("Redis", "redis"),
    ("Redis Cluster", "redis_cluster"),
    ("PostgreSQL", "postgres"),
    ("PgBouncer (transaction)", "pgbouncer_transaction"),
    ("DynamoDB", "dynamodb"),
    ("etcd", "etcd"),
    ("MySQL (MariaDB)", "mysql"),
    ("Redlock (5 Redis masters)", "redlock"),
    ("Azure Blob (Azurite)", "azure_blob"),
    ("S3 (moto)", "s3"),
    ("ZooKeeper", "zookeeper"),
    ("a backend outside the crate", "outside"),
];

/// RELIABILITY.md's conformance table says ✓ exactly where this binary runs a check
/// for a fixture: its list of tests (`--list`) is the suite.
#[cfg(all(
    feature = "redis",
    feature = "postgres",
    feature = "dynamodb",
    feature = "etcd",
    feature = "mysql",
    feature = "azure-blob",
    feature = "zookeeper",
    feature = "s3",
    feature = "axum"
))]
#[test]
fn reliability_table_matches_the_suite() {
    use std::collections::BTreeSet;

    let listed = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--list", "--format", "terse"])
        .output()
        .expect("the test binary lists its tests");
    let listed = String::from_utf8(listed.stdout).unwrap();
    let mut run: BTreeSet<(String, String)> = BTreeSet::new();
    // This module's tests, in the `backends` binary.
    let names = listed
        .lines()
        .filter_map(|line| line.strip_suffix(": test"));
    for name in names.filter_map(|name| name.strip_prefix("conformance::")) {
        let parts: Vec<&str> = name.split("::").collect();
        match parts.as_slice() {
            ["faults" | "through_the_layer" | "modes" | "inspect" | "footprint", fixture, check]
            | [fixture, check] => {
                run.insert((fixture.to_string(), check.to_string()));
            }
            ["a_backend_written_outside_the_crate_conforms"] => {
                for check in tower_keyed_lock::testkit::CHECKS {
                    run.insert(("outside".into(), check.into()));
                }
            }
            _ => {}
        }
    }

    let document =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/RELIABILITY.md")).unwrap();
    let table = document
        .split("<!-- conformance-table: begin -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- conformance-table: end -->").next())
        .expect("RELIABILITY.md has the conformance table between its markers");
    let mut rows = table.lines().filter(|line| line.starts_with('|'));
    let header: Vec<&str> = rows.next().unwrap().split('|').map(str::trim).collect();
    let columns: Vec<&str> = header[2..header.len() - 1]
        .iter()
        .map(|title| {
            COLUMNS
                .iter()
                .find(|(heading, _)| heading == title)
                .unwrap_or_else(|| panic!("unknown column {title:?} in RELIABILITY.md"))
                .1
        })
        .collect();
    let mut documented: BTreeSet<(String, String)> = BTreeSet::new();
    for row in rows.skip(1) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let check = cells[1].trim_matches('`');
        for (fixture, cell) in columns.iter().zip(&cells[2..]) {
            if *cell == "✓" {
                documented.insert((fixture.to_string(), check.to_owned()));
            }
        }
    }
    let undocumented: Vec<_> = run.difference(&documented).collect();
    let unrun: Vec<_> = documented.difference(&run).collect();
    assert!(
        undocumented.is_empty() && unrun.is_empty(),
        "RELIABILITY.md's conformance table and the suite disagree:\n\
         run but not marked ✓: {undocumented:?}\n\
         marked ✓ but not run: {unrun:?}"
    );
}
