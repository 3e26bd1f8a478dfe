//! The PostgreSQL backend, uncontended: one acquire and release through
//! `PostgresBackend` (pool checkout, the granting statement — `pg_try_advisory_lock`
//! with the session's pid, marker and limits —, the lease's watch task, the unlock that
//! resets them, pool return) against the bare minimum on one connection — a
//! prepared `pg_try_advisory_lock` then a prepared `pg_advisory_unlock` — in the same
//! run, on a PostgreSQL server the bench starts itself (as the tests do: `PG_BIN` or
//! the newest `/usr/lib/postgresql/*/bin`; `./scripts/test` installs it).
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-pg cargo bench -p tower-keyed-lock-benches --bench postgres
//! cargo bench -p tower-keyed-lock-benches --bench postgres -- --test     # CI: each once
//! ```
//!
//! Both are two round trips to a local server, so the ratio is what the backend adds
//! to them (target ≤ 1.3×). The bare pair runs on the very connection the backend uses
//! (its pool holds one, checked out for the bare batches): round-trip times differ
//! from one server process to another by up to 3× on a busy machine, which would
//! swamp the comparison. Besides criterion's figures, the two also run in alternating
//! batches (A B, B A, …: the same load hits both) and the median ratio of the rounds
//! is printed; criterion times one benchmark after another, which a busy machine
//! skews. `backend-fencing` adds the sequence's `nextval` to the grant (on a
//! connection of its own); `backend-transaction` is `LockScope::Transaction`
//! (`BEGIN … pg_try_advisory_xact_lock`, then `ROLLBACK`).

#[path = "../tests/support/pg_server.rs"]
mod pg_server;
#[path = "../tests/support/ports.rs"]
mod ports;

use std::time::{Duration, Instant};

use criterion::Criterion;
use deadpool_postgres::Object;
use pg_server::PgServer;
use tokio::runtime::Runtime;
use tokio_postgres::Statement;
use tower_keyed_lock::backend::postgres::{LockScope, PostgresBackend};
use tower_keyed_lock::{Key, LockBackend};

const NAME: &str = "bench";

fn main() {
    let mut c = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .configure_from_args();
    let test_mode = std::env::args().any(|arg| arg == "--test");
    let pg = PgServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");

    let backend = PostgresBackend::from_config_str(&pg.conn_str())
        .unwrap()
        .max_connections(1);
    let fencing = PostgresBackend::from_config_str(&pg.conn_str())
        .unwrap()
        .max_connections(2)
        .fencing(true);
    let transaction = PostgresBackend::from_config_str(&pg.conn_str())
        .unwrap()
        .max_connections(1)
        .lock_scope(LockScope::Transaction);
    let key = Key::new("order-1", 64).unwrap();

    let mut group = c.benchmark_group("postgres-uncontended");
    group.bench_function("bare-try-unlock", |b| {
        let bare = rt.block_on(Bare::check_out(&backend));
        b.to_async(&rt).iter(|| bare.lock_unlock())
    });
    group.bench_function("backend", |b| {
        b.to_async(&rt).iter(|| lock_unlock(&backend, &key))
    });
    group.bench_function("backend-fencing", |b| {
        b.to_async(&rt).iter(|| lock_unlock(&fencing, &key))
    });
    group.bench_function("backend-transaction", |b| {
        b.to_async(&rt).iter(|| lock_unlock(&transaction, &key))
    });
    group.finish();

    if !test_mode {
        alternating(&rt, &backend, &key);
    }
    c.final_summary();
    drop(pg);
}

/// The backend's connection, checked out of its pool (and returned on drop), with
/// the two statements prepared.
struct Bare {
    client: Object,
    try_lock: Statement,
    unlock: Statement,
    id: i64,
}

impl Bare {
    async fn check_out(backend: &PostgresBackend) -> Bare {
        let client = backend.pool().get().await.expect("a connection");
        let try_lock = client
            .prepare("SELECT pg_try_advisory_lock($1)")
            .await
            .unwrap();
        let unlock = client
            .prepare("SELECT pg_advisory_unlock($1)")
            .await
            .unwrap();
        Bare {
            client,
            try_lock,
            unlock,
            // Another id than the backend's: the two never contend.
            id: 42,
        }
    }

    async fn lock_unlock(&self) {
        let row = self
            .client
            .query_one(&self.try_lock, &[&self.id])
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0));
        let row = self
            .client
            .query_one(&self.unlock, &[&self.id])
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0));
    }
}

async fn lock_unlock(backend: &PostgresBackend, key: &Key) {
    let lease = backend
        .acquire(NAME, key, Duration::ZERO)
        .await
        .expect("uncontended");
    lease.release().await;
}

/// Rounds of `BATCH` iterations of each, alternating which goes first; prints the
/// median per-iteration times and the median of the per-round ratios.
fn alternating(rt: &Runtime, backend: &PostgresBackend, key: &Key) {
    const ROUNDS: usize = 40;
    const BATCH: u32 = 200;
    let (mut bare_times, mut backend_times, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    rt.block_on(async {
        for round in 0..ROUNDS {
            let mut time_bare = Duration::ZERO;
            let mut time_backend = Duration::ZERO;
            for turn in 0..2 {
                let started = Instant::now();
                if (round + turn) % 2 == 0 {
                    let bare = Bare::check_out(backend).await;
                    let started = Instant::now();
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
         acquire+release; median ratio {:.2}x (target <= 1.3x)",
        bare_times[ROUNDS / 2],
        backend_times[ROUNDS / 2],
        ratios[ROUNDS / 2]
    );
}
