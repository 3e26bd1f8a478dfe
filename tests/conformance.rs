//! The backend conformance suite (`tower_keyed_lock::testkit`), run for every backend
//! against a real server — Redis, a Redis Cluster, PostgreSQL, DynamoDB (moto) — and for
//! a backend written outside the crate, as a user would write one.
#![cfg(feature = "testkit")]
#![cfg_attr(
    not(any(feature = "redis", feature = "postgres", feature = "dynamodb")),
    allow(dead_code)
)]

#[cfg(feature = "redis")]
#[path = "support/redis_cluster.rs"]
mod cluster_server;
#[cfg(feature = "dynamodb")]
#[path = "support/dynamo_server.rs"]
mod dynamo_server;
#[cfg(feature = "postgres")]
#[path = "support/pg_server.rs"]
mod pg_server;
#[cfg(feature = "redis")]
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "distributed/servers.rs"]
mod servers;
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use servers::{Fixture, Remote};
use tokio::time::{sleep, sleep_until, Instant};
use tower_keyed_lock::backend::{BoxFuture, LeaseLostSender, ReleaseLease};
use tower_keyed_lock::testkit::Deployment;
use tower_keyed_lock::{Key, Lease, LeaseSignal, LockBackend, LockError};

/// A fixture's server, as the suite sees it.
struct Conformance<F>(F);

impl<F: Fixture + Remote + Send + Sync> Deployment for Conformance<F> {
    async fn backend(&self) -> Arc<dyn LockBackend> {
        self.0.backend("instance").await
    }

    fn loss_bound(&self) -> Duration {
        self.0.loss_bound()
    }
}

/// `conformance!(fixture_module, Fixture, "feature")`: one test per check.
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
            );
        }
    };
    (@checks $fixture:ty; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                let deployment = crate::Conformance(<$fixture as crate::servers::Fixture>::start());
                tower_keyed_lock::testkit::$check(&deployment).await;
            }
        )*
    };
}

conformance!(redis, crate::servers::Redis, "redis");
conformance!(redis_cluster, crate::servers::RedisCluster, "redis");
conformance!(postgres, crate::servers::Postgres, "postgres");
conformance!(dynamodb, crate::servers::DynamoDb, "dynamodb");

// ------------------------------------------------- a backend written outside the crate

/// A lock service of its own, as a user might write one over their engine: a shared
/// table of holders with expiries, fencing counters, and leases renewed at a third.
#[derive(Clone, Default)]
struct TableService(Arc<Mutex<Table>>);

#[derive(Default)]
struct Table {
    holders: HashMap<String, (u64, Instant)>,
    fences: HashMap<String, u64>,
    next_owner: u64,
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
            .is_some_and(|(_, expires)| now < *expires)
        {
            return None;
        }
        table.next_owner += 1;
        let owner = table.next_owner;
        table.holders.insert(key.to_owned(), (owner, now + LEASE));
        let fence = table.fences.entry(key.to_owned()).or_default();
        *fence += 1;
        Some((owner, *fence))
    }

    fn renew(&self, key: &str, owner: u64, now: Instant) -> bool {
        let mut table = self.0.lock().unwrap();
        match table.holders.get_mut(key) {
            Some((holder, expires)) if *holder == owner && now < *expires => {
                *expires = now + LEASE;
                true
            }
            _ => false,
        }
    }

    fn release(&self, key: &str, owner: u64) {
        let mut table = self.0.lock().unwrap();
        if table
            .holders
            .get(key)
            .is_some_and(|(holder, _)| *holder == owner)
        {
            table.holders.remove(key);
        }
    }
}

impl LockBackend for TableBackend {
    fn acquire(
        &self,
        name: &str,
        key: &Key,
        wait: Duration,
    ) -> BoxFuture<Result<Lease, LockError>> {
        let service = self.0.clone();
        let key = format!("{name}:{}", key.as_str());
        Box::pin(async move {
            let deadline = Instant::now() + wait;
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
                    return Ok(Lease::new(Some(fence), signal, release));
                }
                if Instant::now() >= deadline {
                    return Err(LockError::Timeout);
                }
                sleep(Duration::from_millis(5).min(deadline - Instant::now())).await;
            }
        })
    }
}

async fn keep(service: TableService, key: String, owner: u64, lost: LeaseLostSender) {
    let mut sent = Instant::now();
    loop {
        sleep_until(sent + LEASE / 3).await;
        sent = Instant::now();
        if !service.renew(&key, owner, sent) || !lost.extend(sent + LEASE) {
            lost.lose();
            return;
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backend_written_outside_the_crate_conforms() {
    tower_keyed_lock::testkit::run_all(&TableDeployment(TableService::default())).await;
}
