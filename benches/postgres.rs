//! The PostgreSQL backend against what a user would pick instead, in one process on a
//! PostgreSQL server the bench starts itself (as the tests do: `PG_BIN` or the newest
//! `/usr/lib/postgresql/*/bin`; `./scripts/test` installs it).
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench postgres
//! cargo bench -p tower-keyed-lock-benches --bench postgres -- --test     # CI: short rounds
//! ```
//!
//! With the defaults a production user gets, plus fencing (`fencing(true)`): the holder
//! record, the liveness checks and the lost-lease watch all on.
//!
//! 1. **Uncontended acquire + release**, 1 task and 32 tasks (each its own key): the
//!    crate through `DistributedLocks` (the in-process tier, then the backend) and
//!    through `PostgresBackend` directly (`acquire`, `Lease::release`), against the
//!    bare pair on prepared statements — `pg_advisory_lock($1)`,
//!    `pg_advisory_unlock($1)` on a connection per task, and the same through a
//!    deadpool pool — and sqlx's `PgAdvisoryLock` (`acquire` on a pooled connection,
//!    `release_now`). Beside them, the backend's own two statements (read from the
//!    server's log, see 3) sent by a bare client on a connection per task: what the
//!    statements cost the server and the wire, apart from the backend's client side.
//!    Interleaved rounds: each round runs every contender for one
//!    batch, the order turning from round to round, so all see the same load; printed
//!    are the medians of the per-round speed ratios (bare time / crate time: above 1 is
//!    faster than the pair).
//! 2. **Hot key, 2 instances × 32 tasks**: every task locks one key, counts, releases,
//!    again, for a fixed time: the crate (two `DistributedLocks`, each with a backend of
//!    its own) against 64 bare sessions queued in PostgreSQL itself
//!    (`pg_advisory_lock` / `pg_advisory_unlock`). Hand-offs per second (grants), their
//!    ratio, and Jain's fairness index over the tasks' grants
//!    ((Σx)² / (n·Σx²): 1 when every task got as many).
//! 3. **Statements per acquire + release**: the server logs every statement
//!    (`log_statement = all`, set with `ALTER SYSTEM` for the count only) and the
//!    lines between two markers are counted over 200 uncontended locks of one key,
//!    prepared statements warmed up. A simple-query message of several statements is
//!    one line and one round trip, as is one `Bind`/`Execute` of a prepared statement.
//! 4. **Steps apart**, one task: the backend's acquire and its release each timed on
//!    its own, beside the bare `pg_advisory_lock` and `pg_advisory_unlock` they stand
//!    for, call by call: where the time over the bare pair goes.
//!
//! What each statement of an uncontended lock is for (see the backend's module docs):
//!
//! - the **try** (prepared, one round trip): `pg_try_advisory_lock(id)`, and only when
//!   granted `nextval` of the fencing sequence (the token), the session's marker
//!   `tower_keyed_lock.lease` (which tells a transaction pooler's shared session) and
//!   the holder record in `application_name`; it answers the server process id (the
//!   holder's identity, compared at every check) and whether this session was checked
//!   already. An unchecked session (once per connection) also gets its server-side idle
//!   limits there, and one more round trip confirms its first grant after the granting
//!   transaction ended (a pooler resetting sessions would have dropped the lock);
//! - the **unlock** (prepared, one round trip): `pg_advisory_unlock(id)` on that server
//!   process only, clearing the marker and resetting `application_name` to the name
//!   the session connected with.
//!
//! A wait (the key held elsewhere) adds one simple-query round trip: `lock_timeout`
//! set for its implicit transaction, then `pg_advisory_lock(id)` in PostgreSQL's queue.
//! A holder also runs `SELECT pg_backend_pid()` every liveness interval (1 s): none in
//! a hold shorter than that.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgAdvisoryLock, PgPool, PgPoolOptions};
use support::hot_key::{self, Op};
use support::pg_server::PgServer;
use tokio_postgres::{Client, NoTls, Statement};
use tower_keyed_lock::backend::postgres::PostgresBackend;
use tower_keyed_lock::{DistributedLocks, Key, LockBackend};

const NAME: &str = "bench";
/// Tasks of the many-task runs, and of each instance on the hot key.
const TASKS: usize = 32;
/// Far more than any acquisition here takes.
const WAIT: Duration = Duration::from_secs(10);

fn main() {
    let quick = std::env::args().any(|arg| arg == "--test");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    // Five contenders' 32 connections each, or 64 bare sessions beside two pools.
    let pg = PgServer::start_with_max_connections(300);
    let conn = pg.conn_str();
    let (rounds, batch) = if quick { (2, 5) } else { (21, 100) };

    let statements = rt.block_on(statements_per_lock(&pg));
    let contenders = rt.block_on(uncontended_contenders(&conn, &statements));
    for tasks in [1, TASKS] {
        let ratios = rt.block_on(interleaved(&contenders, tasks, rounds, batch));
        ratios.print(tasks);
    }

    let hot_rounds = if quick { 1 } else { 7 };
    let run = if quick {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(2)
    };
    rt.block_on(hot_key(&conn, hot_rounds, run));

    rt.block_on(steps_apart(&conn, if quick { 20 } else { 2000 }));
    drop(pg);
}

/// The backend as the bench uses it: fencing on, a pool for `TASKS` keys at once.
fn backend(conn: &str) -> PostgresBackend {
    PostgresBackend::builder_from_str(conn)
        .unwrap()
        .max_connections(TASKS)
        .fencing(true)
        .build_lazy()
}

fn task_key(task: usize) -> String {
    format!("order-{task}")
}

/// A connection of its own with the bare pair prepared on it.
struct Bare {
    client: Client,
    lock: Statement,
    unlock: Statement,
}

impl Bare {
    async fn connect(conn: &str) -> Bare {
        let (client, connection) = tokio_postgres::connect(conn, NoTls).await.unwrap();
        tokio::spawn(connection);
        let lock = client.prepare("SELECT pg_advisory_lock($1)").await.unwrap();
        let unlock = client
            .prepare("SELECT pg_advisory_unlock($1)")
            .await
            .unwrap();
        Bare {
            client,
            lock,
            unlock,
        }
    }

    async fn lock_unlock(&self, id: i64) {
        self.client.execute(&self.lock, &[&id]).await.unwrap();
        let row = self.client.query_one(&self.unlock, &[&id]).await.unwrap();
        assert!(row.get::<_, bool>(0), "the bare lock was not held");
    }
}

/// The backend's two statements of an uncontended lock as it prepared them (read from
/// the server's log): the try and the unlock.
struct Statements {
    try_lock: String,
    unlock: String,
}

/// The backend's statements on a connection of their own, sent as a bare client sends
/// the pair: what they cost the server and the wire, apart from the backend's client
/// side.
struct BareStatements {
    client: Client,
    try_lock: Statement,
    unlock: Statement,
    pid: i32,
}

impl BareStatements {
    async fn connect(conn: &str, statements: &Statements) -> BareStatements {
        let (client, connection) = tokio_postgres::connect(conn, NoTls).await.unwrap();
        tokio::spawn(connection);
        // Checked, as the backend's sessions are after their first lock: the try sets
        // no session limits.
        client
            .batch_execute("SELECT set_config('tower_keyed_lock.checked', 'on', false)")
            .await
            .unwrap();
        let try_lock = client.prepare(&statements.try_lock).await.unwrap();
        let unlock = client.prepare(&statements.unlock).await.unwrap();
        let pid = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        BareStatements {
            client,
            try_lock,
            unlock,
            pid,
        }
    }

    async fn lock_unlock(&self, id: i64) {
        let marker = format!("{id}/0123456789abcdef");
        let tried = self
            .client
            .query_one(&self.try_lock, &[&id, &marker])
            .await
            .unwrap();
        assert_eq!(tried.get::<_, Option<bool>>(1), Some(true), "not granted");
        let unlocked = self
            .client
            .query_one(&self.unlock, &[&id, &self.pid])
            .await
            .unwrap();
        assert_eq!(unlocked.get::<_, Option<bool>>(0), Some(true), "not held");
    }
}

async fn sqlx_pool(conn: &str, size: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .connect(&sqlx_url(conn))
        .await
        .expect("sqlx connects")
}

/// The tests' `key=value` connection string as the URL sqlx takes.
fn sqlx_url(conn: &str) -> String {
    let value = |name: &str| {
        conn.split_whitespace()
            .find_map(|pair| pair.strip_prefix(&format!("{name}=")))
            .unwrap_or_default()
            .to_owned()
    };
    format!(
        "postgres://{}@{}:{}/{}",
        value("user"),
        value("host"),
        value("port"),
        value("dbname")
    )
}

/// The four ways to lock and release a task's own key, warmed up (connections open,
/// statements prepared).
async fn uncontended_contenders(conn: &str, statements: &Statements) -> Vec<(&'static str, Op)> {
    let locks = DistributedLocks::new(NAME, backend(conn));
    let direct = backend(conn);
    let keys: Arc<Vec<Key>> = Arc::new(
        (0..TASKS)
            .map(|task| Key::new(&task_key(task), 64).unwrap())
            .collect(),
    );
    let mut bare = Vec::new();
    for _ in 0..TASKS {
        bare.push(Bare::connect(conn).await);
    }
    let bare = Arc::new(bare);
    let mut its_statements = Vec::new();
    for _ in 0..TASKS {
        its_statements.push(BareStatements::connect(conn, statements).await);
    }
    let its_statements = Arc::new(its_statements);
    let pool = sqlx_pool(conn, TASKS as u32).await;
    let sqlx_locks: Arc<Vec<PgAdvisoryLock>> = Arc::new(
        (0..TASKS)
            .map(|task| PgAdvisoryLock::new(task_key(task)))
            .collect(),
    );

    // The bare pair through a deadpool pool as the backend's own (last in, first out:
    // the connection just given back, whose server process is awake): what the pool
    // costs.
    let pooled = {
        let mut config = deadpool_postgres::Config::new();
        config.url = Some(conn.to_owned());
        config.manager = Some(deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        });
        let mut pool = deadpool_postgres::PoolConfig::new(TASKS);
        pool.queue_mode = deadpool_postgres::QueueMode::Lifo;
        config.pool = Some(pool);
        config
            .create_pool(Some(deadpool_postgres::Runtime::Tokio1), NoTls)
            .unwrap()
    };
    let contenders: Vec<(&'static str, Op)> = vec![
        ("bare pair", {
            Arc::new(move |task| {
                let bare = bare.clone();
                Box::pin(async move { bare[task].lock_unlock(1000 + task as i64).await })
            })
        }),
        ("pooled pair", {
            Arc::new(move |task| {
                let pooled = pooled.clone();
                Box::pin(async move {
                    let id = 1000 + task as i64;
                    let client = pooled.get().await.unwrap();
                    let lock = client
                        .prepare_cached("SELECT pg_advisory_lock($1)")
                        .await
                        .unwrap();
                    client.execute(&lock, &[&id]).await.unwrap();
                    let unlock = client
                        .prepare_cached("SELECT pg_advisory_unlock($1)")
                        .await
                        .unwrap();
                    client.query_one(&unlock, &[&id]).await.unwrap();
                })
            })
        }),
        ("its statements, bare", {
            Arc::new(move |task| {
                let its_statements = its_statements.clone();
                Box::pin(async move { its_statements[task].lock_unlock(1000 + task as i64).await })
            })
        }),
        ("DistributedLocks", {
            Arc::new(move |task| {
                let locks = locks.clone();
                Box::pin(async move {
                    let guard = locks.lock(&task_key(task)).await.expect("uncontended");
                    guard.release().await;
                })
            })
        }),
        ("PostgresBackend", {
            Arc::new(move |task| {
                let (direct, keys) = (direct.clone(), keys.clone());
                Box::pin(async move {
                    let lease = direct
                        .acquire(NAME, &keys[task], WAIT)
                        .await
                        .expect("uncontended");
                    lease.release().await;
                })
            })
        }),
        ("sqlx PgAdvisoryLock", {
            Arc::new(move |task| {
                let (pool, sqlx_locks) = (pool.clone(), sqlx_locks.clone());
                Box::pin(async move {
                    let conn = pool.acquire().await.unwrap();
                    let guard = sqlx_locks[task].acquire(conn).await.unwrap();
                    drop(guard.release_now().await.unwrap());
                })
            })
        }),
    ];
    // Warm up: every task's connection opened and its statements prepared.
    for (_, op) in &contenders {
        run_tasks(op, TASKS, 3).await;
    }
    contenders
}

/// `tasks` tasks, each running `op` `batch` times; how long until all are done.
async fn run_tasks(op: &Op, tasks: usize, batch: usize) -> Duration {
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let op = op.clone();
            tokio::spawn(async move {
                for _ in 0..batch {
                    op(task).await;
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.unwrap();
    }
    started.elapsed()
}

/// The median time per acquire + release of each contender, and the medians of the
/// per-round speed ratios against the bare pair (the first contender).
struct Ratios {
    names: Vec<&'static str>,
    per_op_us: Vec<f64>,
    vs_bare: Vec<f64>,
    vs_sqlx: Vec<f64>,
    rounds: usize,
    batch: usize,
}

impl Ratios {
    fn print(&self, tasks: usize) {
        for (i, name) in self.names.iter().enumerate() {
            println!(
                "uncontended, {tasks:>2} task(s): {name:<20} {:>7.1} µs per acquire+release \
                 (all tasks), {:.2}x the bare pair's speed, {:.2}x sqlx's \
                 (medians of {} interleaved rounds of {} per task)",
                self.per_op_us[i], self.vs_bare[i], self.vs_sqlx[i], self.rounds, self.batch
            );
        }
    }
}

async fn interleaved(
    contenders: &[(&'static str, Op)],
    tasks: usize,
    rounds: usize,
    batch: usize,
) -> Ratios {
    let n = contenders.len();
    let mut times = vec![Vec::new(); n];
    for round in 0..rounds {
        for turn in 0..n {
            let i = (round + turn) % n;
            times[i].push(run_tasks(&contenders[i].1, tasks, batch).await);
        }
    }
    let sqlx = n - 1;
    let ratio_to = |of: usize, to: usize| {
        median(
            (0..rounds)
                .map(|r| times[to][r].as_secs_f64() / times[of][r].as_secs_f64())
                .collect(),
        )
    };
    Ratios {
        names: contenders.iter().map(|(name, _)| *name).collect(),
        per_op_us: (0..n)
            .map(|i| {
                median(
                    times[i]
                        .iter()
                        .map(|t| t.as_secs_f64() * 1e6 / (tasks * batch) as f64)
                        .collect(),
                )
            })
            .collect(),
        vs_bare: (0..n).map(|i| ratio_to(i, 0)).collect(),
        vs_sqlx: (0..n).map(|i| ratio_to(i, sqlx)).collect(),
        rounds,
        batch,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One key, 2 instances × 32 tasks against 64 bare sessions; interleaved rounds.
async fn hot_key(conn: &str, rounds: usize, run: Duration) {
    let instances = [
        DistributedLocks::new(NAME, backend(conn)),
        DistributedLocks::new(NAME, backend(conn)),
    ];
    let ours = hot_key::locking(instances);
    let mut sessions = Vec::new();
    for _ in 0..2 * TASKS {
        sessions.push(Bare::connect(conn).await);
    }
    let sessions = Arc::new(sessions);
    let bare: Op = Arc::new(move |task| {
        let sessions = sessions.clone();
        Box::pin(async move { sessions[task].lock_unlock(7).await })
    });
    let hot = hot_key::interleaved([&ours, &bare], 2 * TASKS, rounds, run).await;
    let ([ours_rate, bare_rate], [ours_fair, bare_fair]) = (hot.rates, hot.fairness);
    println!(
        "hot key, 2 instances x {TASKS} tasks: {ours_rate:.0} hand-offs/s (Jain {ours_fair:.3}) \
         vs 64 bare sessions {bare_rate:.0}/s (Jain {bare_fair:.3}): {:.2}x \
         (median of {rounds} interleaved rounds of {run:?})",
        hot.ratios[1]
    );
}

/// Statements the server ran per uncontended acquire + release, from its log.
async fn statements_per_lock(pg: &PgServer) -> Statements {
    const LOCKS: usize = 200;
    let (admin, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let backend = backend(&pg.conn_str());
    let key = Key::new("counted", 64).unwrap();
    let lock = || async {
        let lease = backend.acquire(NAME, &key, WAIT).await.unwrap();
        lease.release().await;
    };
    for _ in 0..3 {
        lock().await;
    }
    // One statement a message: `ALTER SYSTEM` runs outside a transaction block only.
    for sql in [
        "ALTER SYSTEM SET log_statement = 'all'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    // The reload reaches every server process at its next command.
    tokio::time::sleep(Duration::from_millis(300)).await;
    lock().await;
    admin.batch_execute("SELECT 'count-start'").await.unwrap();
    for _ in 0..LOCKS {
        lock().await;
    }
    admin.batch_execute("SELECT 'count-end'").await.unwrap();
    for sql in [
        "ALTER SYSTEM RESET log_statement",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    let log = pg.log();
    let counted = log
        .split("count-start")
        .nth(1)
        .and_then(|rest| rest.split("count-end").next())
        .unwrap_or_default();
    let statements = counted
        .lines()
        .filter(|line| line.contains("LOG:  statement:") || line.contains("LOG:  execute"))
        .count();
    println!(
        "statements per uncontended acquire+release (PostgresBackend, fencing on): {:.2} \
         ({statements} logged for {LOCKS}; the bare pair: 2)",
        statements as f64 / LOCKS as f64
    );
    // `... LOG:  execute <name>: <the prepared statement's text>`
    let prepared = |marking: &str| {
        counted
            .lines()
            .filter_map(|line| line.split_once("LOG:  execute ")?.1.split_once(": "))
            .map(|(_, sql)| sql)
            .find(|sql| sql.contains(marking))
            .unwrap_or_else(|| panic!("no statement with {marking} in the log"))
            .to_owned()
    };
    Statements {
        try_lock: prepared("pg_try_advisory_lock($1)"),
        unlock: prepared("pg_advisory_unlock($1)"),
    }
}

/// Each step of one lock timed on its own, one task, beside the bare call it stands
/// for on the same server: the backend's acquire against a bare `pg_advisory_lock`,
/// its release against a bare `pg_advisory_unlock`, alternating call by call so both
/// see the same load. Medians of `locks` of each.
async fn steps_apart(conn: &str, locks: usize) {
    let direct = backend(conn);
    let bare = Bare::connect(conn).await;
    let key = Key::new("steps", 64).unwrap();
    let mut times: [Vec<Duration>; 4] = Default::default();
    for round in 0..locks + 20 {
        let started = Instant::now();
        let lease = direct.acquire(NAME, &key, WAIT).await.expect("uncontended");
        let acquired = Instant::now();
        lease.release().await;
        let released = Instant::now();
        bare.client.execute(&bare.lock, &[&7i64]).await.unwrap();
        let locked = Instant::now();
        bare.client.execute(&bare.unlock, &[&7i64]).await.unwrap();
        let unlocked = Instant::now();
        // The first ones open the connections and prepare the statements.
        if round >= 20 {
            let steps = [
                acquired - started,
                released - acquired,
                locked - released,
                unlocked - locked,
            ];
            for (times, step) in times.iter_mut().zip(steps) {
                times.push(step);
            }
        }
    }
    let [acquire, release, lock, unlock] = times.map(|mut times| {
        times.sort();
        times[times.len() / 2].as_secs_f64() * 1e6
    });
    println!(
        "steps apart, 1 task (medians of {locks}): acquire {acquire:.1} µs against a bare \
         lock's {lock:.1} µs (+{:.1}); release {release:.1} µs against a bare unlock's \
         {unlock:.1} µs (+{:.1})",
        acquire - lock,
        release - unlock
    );
}
