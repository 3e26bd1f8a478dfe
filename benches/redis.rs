//! What one Redis lock costs, against what a user would pick instead, on a real
//! `redis-server` the bench starts on a free port.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench redis
//! cargo bench -p tower-keyed-lock-benches --bench redis -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release, with 1 task and with 32 tasks at once (each its
//!    own key), four ways in interleaved rounds in one process (the order rotating
//!    from round to round, so every way sees the same load):
//!    - `locks`: [`DistributedLocks`] on a [`RedisBackend`] with the defaults a
//!      production user gets (fencing, holder record, restart guard, renewal on),
//!      `lock` then `release`;
//!    - `backend`: the same backend called directly (`acquire`, `Lease::release`);
//!    - `pair`: the bare safe pair, `SET key token NX PX` and a compare-and-delete
//!      script (`EVALSHA`), on a `ConnectionManager` of the same client;
//!    - `rslock`: the `rslock` crate's `LockManager` on the same server (`lock`,
//!      `unlock`).
//!
//!    Printed: the median time per acquire + release of each, and the medians of the
//!    per-round ratios `pair / locks`, `pair / backend`, `rslock / locks` (above 1: the
//!    crate is faster). The machine may be shared and loaded: only the ratios count.
//! 2. Redis commands executed per acquire + release (`INFO commandstats` deltas, the
//!    calls inside scripts included), for each way: round trips are the top-level
//!    commands (scripts and plain commands sent), the rest ran inside scripts; and
//!    the time Redis spent on them (the top-level commands' `usec`).
//! 3. Commands per request when 32 requests for one key arrive at once at one
//!    instance (a layer with the backend, driven with `ServiceExt::oneshot`).
//! 4. Hot key, 2 instances × 32 tasks: every task locks one key, releases, again, for
//!    a fixed time: the crate (two `DistributedLocks`, each with a backend of its own)
//!    against the two-tier shape a user builds from bare commands, per instance a FIFO
//!    mutex (tokio's) in front of the safe pair, its holder sending `SET NX PX` again
//!    at once until granted. Hand-offs per second, their ratio, and Jain's fairness
//!    index over the tasks' grants.
//!
//! For a profiler (`perf record`, `perf stat -p`): `PROFILE_WAY=backend` (or `locks`,
//! `pair`, `rslock`) runs that way alone, 32 tasks, for 12 s, and prints locks per
//! second.

mod support;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use support::hot_key::{self, Op};
use support::redis_pair::{fresh_token, SafePair};
use support::redis_server::{command_calls, command_stat, RedisServer};
use tower::ServiceExt;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::{DistributedLocks, Key, KeyedLockLayer, LockBackend};

const WAITERS: usize = 32;
const TASK_COUNTS: [usize; 2] = [1, 32];

fn main() {
    let quick = std::env::args().any(|arg| arg == "--test");
    let filter: Option<String> = std::env::args().skip(1).find(|arg| !arg.starts_with('-'));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let server = RedisServer::start();
    let client = server.client();
    let ways = rt.block_on(Ways::new(&client));

    if let Ok(name) = std::env::var("PROFILE_WAY") {
        let way = ALL.into_iter().find(|way| way.name() == name);
        let way = way.expect("PROFILE_WAY is one of locks, backend, pair, rslock");
        rt.block_on(profile(Arc::new(ways), way));
        return;
    }
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    let mut lines = Vec::new();
    if wanted("uncontended") {
        let (rounds, ops) = if quick { (2, 64) } else { (21, 1024) };
        for tasks in TASK_COUNTS {
            lines.extend(rt.block_on(uncontended(&ways, tasks, rounds, ops)));
        }
    }
    if wanted("hot") {
        let (rounds, run) = if quick {
            (1, Duration::from_millis(200))
        } else {
            (7, Duration::from_secs(2))
        };
        rt.block_on(hot_key(&client, rounds, run));
    }
    if wanted("commands") {
        let ops = if quick { 20 } else { 500 };
        rt.block_on(commands_per_lock(&server, &ways, ops));
        let rounds = if quick { 1 } else { 10 };
        rt.block_on(commands_per_request(&server, &client, rounds));
    }
    support::write_results("redis", quick, &lines);
}

/// The four ways to take and release a lock, on one server.
struct Ways {
    locks: DistributedLocks,
    backend: RedisBackend,
    pair: SafePair,
    rslock: rslock::LockManager,
}

/// One of the ways, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    Locks,
    Backend,
    Pair,
    Rslock,
}

const ALL: [Way; 4] = [Way::Locks, Way::Backend, Way::Pair, Way::Rslock];

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::Locks => "locks",
            Way::Backend => "backend",
            Way::Pair => "pair",
            Way::Rslock => "rslock",
        }
    }
}

impl Ways {
    async fn new(client: &redis::Client) -> Self {
        let backend = guarded_backend(client).await;
        let ways = Self {
            locks: DistributedLocks::new("bench-locks", backend.clone()),
            backend,
            pair: SafePair::new(client).await,
            rslock: rslock::LockManager::from_clients(vec![client.clone()]),
        };
        // Loads the scripts and opens the connections.
        for way in ALL {
            ways.round(way, "warm-up").await;
        }
        ways
    }

    /// One acquire + release of `key` the given way.
    // Written out for its `Send` bound: the rounds of 32 tasks are spawned.
    #[allow(clippy::manual_async_fn)]
    fn round<'a>(&'a self, way: Way, key: &'a str) -> impl Future<Output = ()> + Send + 'a {
        async move {
            match way {
                Way::Locks => {
                    let guard = self.locks.lock(key).await.expect("an uncontended key");
                    guard.release().await;
                }
                Way::Backend => {
                    let key = Key::new(key, 256).unwrap();
                    let lease = self
                        .backend
                        .acquire("bench-backend", &key, Duration::from_secs(1))
                        .await
                        .expect("an uncontended key");
                    lease.release().await;
                }
                Way::Pair => self.pair.round(&format!("bench-pair:{key}")).await,
                Way::Rslock => {
                    let resource = format!("bench-rslock:{key}");
                    let lock = self
                        .rslock
                        .lock(resource.as_bytes(), Duration::from_secs(30))
                        .await
                        .expect("an uncontended key");
                    self.rslock.unlock(&lock).await;
                }
            }
        }
    }
}

/// `ops` acquire + release rounds spread over `tasks` tasks, each on its own key; the
/// wall time.
async fn batch(ways: &Arc<Ways>, way: Way, tasks: usize, ops: usize) -> Duration {
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for task in 0..tasks {
        let ways = ways.clone();
        let per_task = ops / tasks;
        set.spawn(async move {
            let key = format!("order-{task}");
            for _ in 0..per_task {
                ways.round(way, &key).await;
            }
        });
    }
    while let Some(done) = set.join_next().await {
        done.unwrap();
    }
    started.elapsed()
}

/// One way alone, 32 tasks, for 12 s: for a profiler attached to this process or
/// the server.
async fn profile(ways: Arc<Ways>, way: Way) {
    let started = Instant::now();
    let mut locks = 0;
    while started.elapsed() < Duration::from_secs(12) {
        batch(&ways, way, 32, 4096).await;
        locks += 4096;
    }
    let per_second = locks as f64 / started.elapsed().as_secs_f64();
    println!("{}: {per_second:.0} locks/s", way.name());
}

/// Interleaved rounds of every way; prints medians and per-round ratio medians.
async fn uncontended(ways: &Ways, tasks: usize, rounds: usize, ops: usize) -> Vec<String> {
    // The bench owns `ways` for its whole run; an Arc lets the tasks borrow it.
    let ways = Arc::new(Ways {
        locks: ways.locks.clone(),
        backend: ways.backend.clone(),
        pair: ways.pair.clone(),
        rslock: ways.rslock.clone(),
    });
    let mut times: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut ratios: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        let mut this_round = BTreeMap::new();
        for i in 0..ALL.len() {
            let way = ALL[(round + i) % ALL.len()];
            let time = batch(&ways, way, tasks, ops).await;
            let per_op_us = time.as_secs_f64() * 1e6 / ops as f64;
            this_round.insert(way.name(), per_op_us);
            times.entry(way.name()).or_default().push(per_op_us);
        }
        for (label, faster, slower) in [
            ("pair/locks", "pair", "locks"),
            ("pair/backend", "pair", "backend"),
            ("rslock/locks", "rslock", "locks"),
            ("rslock/backend", "rslock", "backend"),
        ] {
            ratios
                .entry(label)
                .or_default()
                .push(this_round[faster] / this_round[slower]);
        }
    }
    let median = |values: &[f64]| {
        let mut values = values.to_vec();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    println!(
        "redis uncontended acquire+release, {tasks} task(s), median of {rounds} interleaved \
         rounds of {ops}:"
    );
    let mut lines = Vec::new();
    for way in ALL {
        let us = median(&times[way.name()]);
        println!("  {:<8} {us:8.1} µs per lock", way.name());
        lines.push(format!(
            r#"{{"bench":"redis-uncontended","tasks":{tasks},"way":"{}","us":{us:.2}}}"#,
            way.name()
        ));
    }
    for (label, values) in &ratios {
        let ratio = median(values);
        println!("  speed {label:<15} {ratio:.2}x (≥ 1: the crate is as fast)");
        lines.push(format!(
            r#"{{"bench":"redis-uncontended","tasks":{tasks},"ratio":"{label}","value":{ratio:.3}}}"#
        ));
    }
    lines
}

/// Commands executed per acquire + release, each way, from `INFO commandstats`.
async fn commands_per_lock(server: &RedisServer, ways: &Ways, ops: usize) {
    let mut stats = server.connection().await;
    println!("redis commands per uncontended acquire+release ({ops} each, calls inside scripts included):");
    for way in ALL {
        let before = command_calls(&mut stats).await;
        let usec_before = command_stat::<u64>(&mut stats, "usec").await;
        for _ in 0..ops {
            ways.round(way, "order-commands").await;
        }
        // Releases that finish in the background.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let after = command_calls(&mut stats).await;
        let usec_after = command_stat::<u64>(&mut stats, "usec").await;
        let delta = deltas(&before, &after);
        let total: u64 = delta.values().sum();
        let top: u64 = delta
            .iter()
            .filter(|(name, _)| is_top_level(way, name))
            .map(|(_, calls)| calls)
            .sum();
        // A script's time includes the calls inside it: the top-level commands' sum.
        let server_us: u64 = deltas(&usec_before, &usec_after)
            .iter()
            .filter(|(name, _)| is_top_level(way, name))
            .map(|(_, usec)| usec)
            .sum();
        println!(
            "  {:<8} {:.2} commands, {:.2} round trips, {:.1} µs in Redis: {}",
            way.name(),
            total as f64 / ops as f64,
            top as f64 / ops as f64,
            server_us as f64 / ops as f64,
            delta
                .iter()
                .map(|(name, calls)| format!("{name} {:.2}", *calls as f64 / ops as f64))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

/// Which commands a way sends itself (the rest run inside its scripts).
fn is_top_level(way: Way, name: &str) -> bool {
    match way {
        Way::Locks | Way::Backend => matches!(name, "eval" | "evalsha" | "script|load"),
        Way::Pair => matches!(name, "set" | "evalsha" | "eval"),
        Way::Rslock => matches!(name, "set" | "evalsha" | "eval"),
    }
}

/// Calls per command between two `INFO commandstats` reads, without the reads: the
/// second read counts the first (a command is counted once it ran), so one `info` is
/// taken off; the rest (the restart guard's `INFO server`) stays.
fn deltas(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(name, calls)| {
            let mut delta = calls - before.get(name).copied().unwrap_or(0);
            if name == "info" {
                delta = delta.saturating_sub(1);
            }
            (name.clone(), delta)
        })
        .filter(|(_, calls)| *calls > 0)
        .collect()
}

/// A backend as deployed (restart guard on), on a server past the guard: a short
/// lease, and a wait of one lease and a second after the server started.
async fn guarded_backend(client: &redis::Client) -> RedisBackend {
    let lease = Duration::from_secs(1);
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    RedisBackend::builder(client.clone())
        .lease(lease)
        .build()
        .await
        .unwrap()
}

/// 32 requests for one key at once, `rounds` times, through a layer with the backend.
async fn commands_per_request(server: &RedisServer, client: &redis::Client, rounds: usize) {
    let backend = guarded_backend(client).await;
    let app = Router::new()
        .route(
            "/orders/{order_id}",
            post(|| async {
                // Long enough for all 32 to queue behind the first.
                tokio::time::sleep(Duration::from_micros(200)).await;
            }),
        )
        .layer(
            KeyedLockLayer::by_path("order_id")
                .name("bench")
                .backend(backend),
        );
    let mut stats = server.connection().await;
    // Warm-up: loads the scripts.
    send(app.clone()).await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    let before = command_calls(&mut stats).await;
    for _ in 0..rounds {
        let requests: Vec<_> = (0..WAITERS)
            .map(|_| tokio::spawn(send(app.clone())))
            .collect();
        for request in requests {
            request.await.unwrap();
        }
    }
    // Releases finish in the background after the responses.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let after = command_calls(&mut stats).await;

    let requests = (rounds * WAITERS) as f64;
    let mut delta = deltas(&before, &after);
    let scripts = delta.remove("evalsha").unwrap_or(0) + delta.remove("eval").unwrap_or(0);
    let inside: u64 = delta.values().sum();
    println!(
        "redis commands per request, {WAITERS} local waiters on one key, {} requests:",
        rounds * WAITERS
    );
    println!(
        "  sent to Redis (script calls = round trips): {:.2}",
        scripts as f64 / requests
    );
    println!(
        "  run inside those scripts: {:.2} ({})",
        inside as f64 / requests,
        delta
            .iter()
            .map(|(name, calls)| format!("{name} {:.2}", *calls as f64 / requests))
            .collect::<Vec<_>>()
            .join(", ")
    );
}

async fn send(app: Router) {
    let request = Request::post("/orders/1").body(Body::empty()).unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

/// One key, 2 instances × `WAITERS` tasks: the crate against two instances of a FIFO
/// mutex in front of the bare pair; interleaved rounds.
async fn hot_key(client: &redis::Client, rounds: usize, run: Duration) {
    let instance = || async {
        // Past the restart guard already (`Ways::new` waited it out).
        let backend = RedisBackend::builder(client.clone())
            .lease(Duration::from_secs(1))
            .build()
            .await
            .unwrap();
        DistributedLocks::new("bench-hot", backend)
    };
    let ours = hot_key::locking([instance().await, instance().await]);
    let mut tiers = Vec::new();
    for _ in 0..2 {
        tiers.push(Arc::new((
            tokio::sync::Mutex::new(()),
            SafePair::new(client).await,
        )));
    }
    let bare: Op = Arc::new(move |task| {
        let tier = tiers[task % 2].clone();
        Box::pin(async move {
            let (local, pair) = &*tier;
            let _local = local.lock().await;
            let token = fresh_token();
            while !pair.set("hot-bare", &token).await {}
            assert!(
                pair.delete("hot-bare", &token).await,
                "the bare key was lost"
            );
        })
    });
    let hot = hot_key::interleaved([&ours, &bare], 2 * WAITERS, rounds, run).await;
    let ([ours_rate, bare_rate], [ours_fair, bare_fair]) = (hot.rates, hot.fairness);
    println!(
        "redis hot key, 2 instances x {WAITERS} tasks: {ours_rate:.0} hand-offs/s (Jain \
         {ours_fair:.3}) vs the two-tier bare shape {bare_rate:.0}/s (Jain {bare_fair:.3}): \
         {:.2}x (median of {rounds} interleaved rounds of {run:?})",
        hot.ratios[1]
    );
}
