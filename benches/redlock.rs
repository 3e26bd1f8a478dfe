//! The Redlock backend against five real `redis-server` masters the bench starts on
//! free ports, beside the single-Redis backend on one of them.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench redlock
//! cargo bench -p tower-keyed-lock-benches --bench redlock -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release of one key: `RedlockBackend` (`acquire` then
//!    `Lease::release`: the acquire script on five masters at once, done at the third
//!    grant; compare-and-delete on all five, done when all answered) against the bare
//!    protocol sent the same way: `SET key token NX PX` to the five masters at once
//!    through one `ConnectionManager` each, done at the third OK, then `DEL` to all
//!    five, done when all answered. Criterion times each; then both run in
//!    alternating batches (A B, B A, …) and the median ratio is printed. The same for
//!    `RedisBackend` against a bare `SET NX PX` + `DEL` on one master.
//! 2. Hand-off between two instances: instance A holds the key, instance B waits for
//!    it, A releases; the time from the start of A's release to B's grant. Redlock
//!    polls (jittered, 5 ms doubling to the poll interval, cut to the holder's TTL);
//!    Redis wakes B with a release message.

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use redis::aio::ConnectionManager;
use redis_server::RedisServer;
use tokio::task::JoinSet;
use tower_keyed_lock::backend::redlock::RedlockBackend;
use tower_keyed_lock::{Key, LockBackend, RedisBackend};

const MASTERS: usize = 5;

fn main() {
    let mut c = Criterion::default()
        .sample_size(30)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .configure_from_args();
    let quick = std::env::args().any(|arg| arg == "--test");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let masters: Vec<RedisServer> = (0..MASTERS).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let redlock = rt.block_on(redlock_backend(&urls));
    let redis = rt.block_on(redis_backend(&masters[0]));
    let bare: Vec<ConnectionManager> = rt.block_on(async {
        let mut connections = Vec::new();
        for master in &masters {
            connections.push(ConnectionManager::new(master.client()).await.unwrap());
        }
        connections
    });
    let key = Key::new("order-1", 256).unwrap();
    // Loads the scripts (the first call of each is NOSCRIPT + SCRIPT LOAD).
    rt.block_on(backend_round(&redlock, &key));
    rt.block_on(backend_round(&redis, &key));

    let mut group = c.benchmark_group("redlock-uncontended");
    group.bench_function("redlock-acquire-release", |b| {
        b.to_async(&rt).iter(|| backend_round(&redlock, &key));
    });
    group.bench_function("bare-5-masters-set-nx-px-del", |b| {
        b.to_async(&rt).iter(|| bare_round(&bare));
    });
    group.bench_function("redis-acquire-release", |b| {
        b.to_async(&rt).iter(|| backend_round(&redis, &key));
    });
    group.bench_function("bare-1-master-set-nx-px-del", |b| {
        b.to_async(&rt).iter(|| bare_round(&bare[..1]));
    });
    group.finish();

    let (rounds, batch) = if quick { (2, 5) } else { (21, 200) };
    let redlock_vs_bare = rt.block_on(alternating(
        || backend_round(&redlock, &key),
        || bare_round(&bare),
        rounds,
        batch,
    ));
    redlock_vs_bare.print("redlock, 5 masters", "bare SET NX PX + DEL on 5 masters");
    let redis_vs_bare = rt.block_on(alternating(
        || backend_round(&redis, &key),
        || bare_round(&bare[..1]),
        rounds,
        batch,
    ));
    redis_vs_bare.print("redis, 1 server", "bare SET NX PX + DEL on 1 server");
    let redlock_vs_redis = rt.block_on(alternating(
        || backend_round(&redlock, &key),
        || backend_round(&redis, &key),
        rounds,
        batch,
    ));
    redlock_vs_redis.print("redlock, 5 masters", "redis, 1 server");

    let handoffs = if quick { 3 } else { 50 };
    let (a, b) = rt.block_on(async {
        let a: Arc<dyn LockBackend> = Arc::new(redlock_backend(&urls).await);
        let b: Arc<dyn LockBackend> = Arc::new(redlock_backend(&urls).await);
        (a, b)
    });
    report("redlock, 5 masters", &rt.block_on(hand_off(a, b, handoffs)));
    let (a, b) = rt.block_on(async {
        let a: Arc<dyn LockBackend> = Arc::new(redis_backend(&masters[1]).await);
        let b: Arc<dyn LockBackend> = Arc::new(redis_backend(&masters[1]).await);
        (a, b)
    });
    report("redis, 1 server", &rt.block_on(hand_off(a, b, handoffs)));
    c.final_summary();
}

/// Redlock as deployed, bar the restart guard (the masters just started): defaults
/// otherwise (30 s lease, 100 ms command timeout, 200 ms poll interval).
async fn redlock_backend(urls: &[String]) -> RedlockBackend {
    RedlockBackend::builder(urls.to_vec())
        .restart_guard(false)
        .build()
        .await
        .expect("the backend reaches the masters")
}

async fn redis_backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::builder(server.client())
        .restart_guard(false)
        .build()
        .await
        .expect("the backend connects to Redis")
}

async fn backend_round(backend: &impl LockBackend, key: &Key) {
    let lease = backend
        .acquire("bench", key, Duration::from_secs(1))
        .await
        .expect("an uncontended key");
    lease.release().await;
}

/// The bare protocol, sent as the backend sends it: `SET NX PX` to every master at
/// once, done at a majority of OKs (the rest run on); then `DEL` to every master at
/// once, done when all answered. One master: a plain `SET NX PX` + `DEL`.
async fn bare_round(masters: &[ConnectionManager]) {
    let majority = masters.len() / 2 + 1;
    let mut sets = JoinSet::new();
    for connection in masters {
        let mut connection = connection.clone();
        sets.spawn(async move {
            let set: Option<String> = redis::cmd("SET")
                .arg("bare:order-1")
                .arg("token")
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut connection)
                .await
                .unwrap();
            set.is_some()
        });
    }
    let mut granted = 0;
    while let Some(set) = sets.join_next().await {
        granted += usize::from(set.unwrap());
        if granted >= majority {
            sets.detach_all();
            break;
        }
    }
    assert!(granted >= majority, "the bare key was held");
    let mut dels = JoinSet::new();
    for connection in masters {
        let mut connection = connection.clone();
        dels.spawn(async move {
            redis::cmd("DEL")
                .arg("bare:order-1")
                .query_async::<()>(&mut connection)
                .await
                .unwrap();
        });
    }
    while let Some(del) = dels.join_next().await {
        del.unwrap();
    }
}

struct Ratio {
    a_us: f64,
    b_us: f64,
    ratio: f64,
    rounds: usize,
    batch: usize,
}

impl Ratio {
    fn print(&self, a: &str, b: &str) {
        println!(
            "uncontended acquire+release: {a} {:.1} µs, {b} {:.1} µs, ratio {:.2}x \
             (median of {} alternating rounds of {})",
            self.a_us, self.b_us, self.ratio, self.rounds, self.batch
        );
    }
}

/// Median over rounds of (batch of `a` / batch of `b`), the order alternating.
async fn alternating<A, B, FA, FB>(a: A, b: B, rounds: usize, batch: usize) -> Ratio
where
    A: Fn() -> FA,
    B: Fn() -> FB,
    FA: std::future::Future<Output = ()>,
    FB: std::future::Future<Output = ()>,
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
/// the time from the start of a's release to b's grant (as `benches/etcd.rs` measures).
async fn hand_off(
    a: Arc<dyn LockBackend>,
    b: Arc<dyn LockBackend>,
    rounds: usize,
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
        // Long enough for b to be waiting (polling, or subscribed) before the release.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        held.release().await;
        let (lease, granted) = waiter.await.expect("the waiter ran");
        lease.expect("b takes the key").release().await;
        times.push(granted.saturating_duration_since(released));
    }
    times.sort();
    times
}

fn report(engine: &str, times: &[Duration]) {
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
