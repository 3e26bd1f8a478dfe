//! Measuring a distributed backend: batches alternating with the engine's bare calls,
//! and hand-offs between two instances.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tokio::runtime::Runtime;
use tower_keyed_lock::{Key, LockBackend, PostgresBackend, RedisBackend};

use super::{pg_server, redis_server};

/// What an engine's bench starts with, and the first measure each one takes.
pub struct EngineBench {
    pub criterion: Criterion,
    /// `--test`: each measure once and small (CI).
    pub quick: bool,
    pub rt: Runtime,
}

impl EngineBench {
    /// Criterion at 30 samples of 3 s, and a runtime of two workers (the machine's
    /// cores).
    pub fn new() -> Self {
        let criterion = Criterion::default()
            .sample_size(30)
            .measurement_time(Duration::from_secs(3))
            .warm_up_time(Duration::from_millis(500))
            .configure_from_args();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let quick = std::env::args().any(|arg| arg == "--test");
        EngineBench {
            criterion,
            quick,
            rt,
        }
    }

    /// Uncontended acquire + release through the backend (`backend`) against the
    /// engine's bare calls (`bare`, named `bare_id` for criterion and described by
    /// `bare_what`): criterion times each in the group `<engine>-uncontended`, then
    /// both run in alternating batches of `batch` and the medians and their ratio are
    /// printed.
    pub fn uncontended<A, B, FA, FB>(
        &mut self,
        engine: &str,
        backend: A,
        (bare_id, bare_what, bare): (&str, &str, B),
        batch: usize,
    ) where
        A: Fn() -> FA,
        B: Fn() -> FB,
        FA: Future<Output = ()>,
        FB: Future<Output = ()>,
    {
        let EngineBench { criterion, rt, .. } = self;
        // One of each first: connections made, scripts loaded, records created.
        rt.block_on(backend());
        rt.block_on(bare());
        let mut group = criterion.benchmark_group(format!("{engine}-uncontended"));
        group.bench_function("backend-acquire-release", |b| {
            b.to_async(&*rt).iter(&backend)
        });
        group.bench_function(bare_id, |b| b.to_async(&*rt).iter(&bare));
        group.finish();

        let (rounds, batch) = if self.quick { (2, 5) } else { (11, batch) };
        let measured = self
            .rt
            .block_on(alternating(&backend, &bare, rounds, batch));
        println!(
            "{engine} uncontended acquire+release: backend {:.0} µs, bare {bare_what} {:.0} \
             µs, ratio {:.2}x (median of {rounds} alternating rounds of {batch})",
            measured.a_us, measured.b_us, measured.ratio
        );
    }

    /// Prints criterion's summary: the end of the run.
    pub fn finish(self) {
        self.criterion.final_summary();
    }
}

/// Two operations timed in alternating batches: medians per operation and of the
/// per-round ratio.
pub struct Ratio {
    pub a_us: f64,
    pub b_us: f64,
    pub ratio: f64,
    pub rounds: usize,
    pub batch: usize,
}

impl Ratio {
    /// One line: both times and their ratio.
    pub fn print(&self, a: &str, b: &str) {
        println!(
            "uncontended acquire+release: {a} {:.1} µs, {b} {:.1} µs, ratio {:.2}x \
             (median of {} alternating rounds of {})",
            self.a_us, self.b_us, self.ratio, self.rounds, self.batch
        );
    }
}

/// Median over rounds of (batch of `a` / batch of `b`), the order alternating from
/// round to round, so both see the same load and drift.
pub async fn alternating<A, B, FA, FB>(a: A, b: B, rounds: usize, batch: usize) -> Ratio
where
    A: Fn() -> FA,
    B: Fn() -> FB,
    FA: Future<Output = ()>,
    FB: Future<Output = ()>,
{
    let mut samples = Vec::new();
    for round in 0..rounds {
        let (mut a_time, mut b_time) = (Duration::ZERO, Duration::ZERO);
        for a_first in [round % 2 == 0, round % 2 != 0] {
            let started = Instant::now();
            for _ in 0..batch {
                if a_first {
                    a().await;
                } else {
                    b().await;
                }
            }
            if a_first {
                a_time = started.elapsed();
            } else {
                b_time = started.elapsed();
            }
        }
        samples.push((a_time, b_time));
    }
    let per_op = |d: Duration| d.as_secs_f64() * 1e6 / batch as f64;
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    Ratio {
        a_us: median(samples.iter().map(|s| per_op(s.0)).collect()),
        b_us: median(samples.iter().map(|s| per_op(s.1)).collect()),
        ratio: median(
            samples
                .iter()
                .map(|s| s.0.as_secs_f64() / s.1.as_secs_f64())
                .collect(),
        ),
        rounds,
        batch,
    }
}

/// `rounds` hand-offs from instance `a` to instance `b` (each with its own backend):
/// the time from the start of a's release to b's grant, sorted. `settle` is how long b
/// waits before each release (long enough to be queued, subscribed, or at its longest
/// polling pause).
pub async fn hand_off(
    a: Arc<dyn LockBackend>,
    b: Arc<dyn LockBackend>,
    rounds: usize,
    settle: Duration,
) -> Vec<Duration> {
    let key = Key::new("handoff", 256).unwrap();
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let held = a
            .acquire("bench", &key, Duration::from_secs(10))
            .await
            .expect("a takes the key");
        let waiter = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move {
                let lease = b.acquire("bench", &key, Duration::from_secs(10)).await;
                (lease, Instant::now())
            })
        };
        tokio::time::sleep(settle).await;
        let released = Instant::now();
        held.release().await;
        let (lease, granted) = waiter.await.expect("the waiter ran");
        lease.expect("b takes the key").release().await;
        times.push(granted.saturating_duration_since(released));
    }
    times.sort();
    times
}

/// Prints the p50, p90 and max of sorted hand-off times.
pub fn report_hand_off(engine: &str, times: &[Duration]) {
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    println!(
        "hand-off release -> next grant, {engine}: p50 {:.2} ms, p90 {:.2} ms, max {:.2} ms \
         ({} hand-offs)",
        at(0.5).as_secs_f64() * 1e3,
        at(0.9).as_secs_f64() * 1e3,
        at(1.0).as_secs_f64() * 1e3,
        times.len()
    );
}

/// Two instances' backends on the Redis server `server` (restart guard off: a server
/// started for the run).
pub async fn redis_instances(
    server: &redis_server::RedisServer,
) -> (Arc<dyn LockBackend>, Arc<dyn LockBackend>) {
    let backend = || async {
        let backend = RedisBackend::builder(server.client())
            .restart_guard(false)
            .build()
            .await
            .expect("the backend connects to Redis");
        Arc::new(backend) as Arc<dyn LockBackend>
    };
    (backend().await, backend().await)
}

/// Two instances' backends on the PostgreSQL server `server`, fencing on.
pub fn postgres_instances(
    server: &pg_server::PgServer,
) -> (Arc<dyn LockBackend>, Arc<dyn LockBackend>) {
    let backend = || {
        let config = server.conn_str().parse().expect("a connection string");
        Arc::new(
            PostgresBackend::builder_from_config(config)
                .fencing(true)
                .build_lazy(),
        ) as Arc<dyn LockBackend>
    };
    (backend(), backend())
}

/// The hand-offs users know, for side-by-side figures: two instances on one Redis
/// (woken by a release message) and on one PostgreSQL (its own lock queue), each on a
/// server started here.
pub fn reference_hand_offs(rt: &tokio::runtime::Runtime, rounds: usize, settle: Duration) {
    {
        let server = redis_server::RedisServer::start();
        let (a, b) = rt.block_on(redis_instances(&server));
        report_hand_off("redis", &rt.block_on(hand_off(a, b, rounds, settle)));
    }
    let server = pg_server::PgServer::start();
    let (a, b) = postgres_instances(&server);
    report_hand_off("postgres", &rt.block_on(hand_off(a, b, rounds, settle)));
}
