//! The MySQL backend on MariaDB, uncontended: one acquire and release through
//! `MySqlBackend` (pool checkout, `SELECT CONNECTION_ID(), GET_LOCK(…)`, the lease's
//! watch task, the checked `RELEASE_LOCK`, pool return; the first grant on a connection
//! also confirms it) against the bare minimum on one connection of its own —
//! `SELECT GET_LOCK(name, 0)` then `SELECT RELEASE_LOCK(name)` — in the same run, on a
//! MariaDB server the bench starts itself (as the tests do; `./scripts/test` installs
//! `mariadb-server`). Then the hand-off between two instances: one holds, the other
//! waits in `GET_LOCK`, the holder releases; the time from the release call to the
//! waiter's grant.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench mysql
//! cargo bench -p tower-keyed-lock-benches --bench mysql -- --test     # CI: each once
//! ```
//!
//! Both are two round trips to a local server, so the ratio is what the backend adds.
//! Besides criterion's figures, the two also run in alternating batches (A B, B A, …:
//! the same load hits both) and the median ratio of the rounds is printed.
//! `backend-fencing` adds the counter's increment, one more round trip.

#[path = "../tests/support/mysql_server.rs"]
mod mysql_server;
#[path = "../tests/support/ports.rs"]
mod ports;
#[path = "../tests/support/process.rs"]
mod process;

use std::time::{Duration, Instant};

use criterion::Criterion;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts};
use mysql_server::MySqlServer;
use tokio::runtime::Runtime;
use tower_keyed_lock::backend::mysql::MySqlBackend;
use tower_keyed_lock::{DistributedLocks, Key, LockBackend};

const NAME: &str = "bench";

fn main() {
    let mut c = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .configure_from_args();
    let test_mode = std::env::args().any(|arg| arg == "--test");
    let server = MySqlServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");

    let backend = MySqlBackend::builder_from_url(&server.url())
        .unwrap()
        .max_connections(1)
        .build_lazy();
    let fencing = MySqlBackend::builder_from_url(&server.url())
        .unwrap()
        .max_connections(1)
        .fencing(true)
        .build_lazy();
    let key = Key::new("order-1", 64).unwrap();
    let mut bare = rt.block_on(Bare::connect(&server.url()));

    let mut group = c.benchmark_group("mysql-uncontended");
    group.bench_function("bare-get-release", |b| {
        b.iter(|| rt.block_on(bare.lock_unlock()))
    });
    group.bench_function("backend", |b| {
        b.to_async(&rt).iter(|| lock_unlock(&backend, &key))
    });
    group.bench_function("backend-fencing", |b| {
        b.to_async(&rt).iter(|| lock_unlock(&fencing, &key))
    });
    group.finish();

    if !test_mode {
        alternating(&rt, &mut bare, &backend, &key);
    }
    hand_off(&server, if test_mode { 3 } else { 200 });
    c.final_summary();
    drop(server);
}

/// A plain connection of the driver, with nothing of the backend.
struct Bare(Conn);

impl Bare {
    async fn connect(url: &str) -> Bare {
        Bare(Conn::new(Opts::from_url(url).unwrap()).await.unwrap())
    }

    async fn lock_unlock(&mut self) {
        // Another name than the backend's: the two never contend.
        let got: Option<i64> = self
            .0
            .query_first("SELECT GET_LOCK('bare', 0)")
            .await
            .unwrap();
        assert_eq!(got, Some(1));
        let released: Option<i64> = self
            .0
            .query_first("SELECT RELEASE_LOCK('bare')")
            .await
            .unwrap();
        assert_eq!(released, Some(1));
    }
}

async fn lock_unlock(backend: &MySqlBackend, key: &Key) {
    let lease = backend
        .acquire(NAME, key, Duration::ZERO)
        .await
        .expect("uncontended");
    lease.release().await;
}

/// Rounds of `BATCH` iterations of each, alternating which goes first; prints the
/// median per-iteration times and the median of the per-round ratios.
fn alternating(rt: &Runtime, bare: &mut Bare, backend: &MySqlBackend, key: &Key) {
    const ROUNDS: usize = 40;
    const BATCH: u32 = 100;
    let (mut bare_times, mut backend_times, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    rt.block_on(async {
        for round in 0..ROUNDS {
            let (mut time_bare, mut time_backend) = (Duration::ZERO, Duration::ZERO);
            for turn in 0..2 {
                let started = Instant::now();
                if (round + turn) % 2 == 0 {
                    for _ in 0..BATCH {
                        bare.lock_unlock().await;
                    }
                    time_bare = started.elapsed() / BATCH;
                } else {
                    for _ in 0..BATCH {
                        lock_unlock(backend, key).await;
                    }
                    time_backend = started.elapsed() / BATCH;
                }
            }
            bare_times.push(time_bare);
            backend_times.push(time_backend);
            ratios.push(time_backend.as_secs_f64() / time_bare.as_secs_f64());
        }
    });
    bare_times.sort();
    backend_times.sort();
    ratios.sort_by(f64::total_cmp);
    println!(
        "alternating batches ({ROUNDS} rounds x {BATCH}): bare {:?}, backend {:?} per \
         acquire+release; median ratio {:.2}x",
        bare_times[ROUNDS / 2],
        backend_times[ROUNDS / 2],
        ratios[ROUNDS / 2]
    );
}

/// Two instances (a backend each, on a multi-thread runtime): the time from the
/// holder's release call to the waiter's grant, `turns` times; prints the median and
/// the 90th percentile.
fn hand_off(server: &MySqlServer, turns: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut times = rt.block_on(async {
        let a = DistributedLocks::new(
            NAME,
            MySqlBackend::builder_from_url(&server.url())
                .unwrap()
                .build_lazy(),
        );
        let b = DistributedLocks::new(
            NAME,
            MySqlBackend::builder_from_url(&server.url())
                .unwrap()
                .build_lazy(),
        );
        let mut times = Vec::with_capacity(turns);
        for _ in 0..turns {
            let held = a.lock("hand-off").await.unwrap();
            let waiter = {
                let b = b.clone();
                tokio::spawn(async move {
                    let guard = b.lock_timeout("hand-off", Duration::from_secs(10)).await;
                    (guard.expect("granted on release"), Instant::now())
                })
            };
            // Let the waiter reach GET_LOCK in the server.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let released = Instant::now();
            held.release().await;
            let (guard, granted) = waiter.await.unwrap();
            times.push(granted.saturating_duration_since(released));
            guard.release().await;
        }
        times
    });
    times.sort();
    println!(
        "hand-off between two instances ({turns} turns): median {:?}, p90 {:?}",
        times[turns / 2],
        times[turns * 9 / 10]
    );
}
