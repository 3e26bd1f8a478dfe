//! Benchmarks of the in-process core, [`KeyedLocks`], against the keyed locks users
//! would write themselves (workloads 1–5 of BENCHMARKS.md), and the cost of withdrawing
//! a queued waiter (workload 6, `6-withdraw`).
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench locks                  # full run (about 3 minutes)
//! cargo bench -p tower-keyed-lock-benches --bench locks -- --test        # CI: each benchmark once
//! cargo bench -p tower-keyed-lock-benches --bench locks -- 3-handoff     # one workload
//! ```
//!
//! Baselines, written here and not dependencies of the crate:
//!
//! - `diy-dashmap`: `DashMap<K, Arc<tokio::sync::Mutex<()>>>` that never removes an
//!   entry (the speed ceiling; it leaks one entry per key ever used);
//! - `diy-dashmap-remove`: the same, removing the entry on release when nobody else holds
//!   its `Arc` (the honest equivalent; it still leaks when a waiter is cancelled after
//!   the mutex was handed to it);
//! - `mutex-hashmap`: one `std::sync::Mutex<HashMap<K, Arc<Semaphore>>>` with removal;
//! - `striped`: 4096 `tokio::sync::Mutex`es chosen by hash (no table at all; unrelated
//!   keys collide).
//!
//! Workloads 1–4 are criterion benchmarks. The target ratios of workloads 1 and 2 are
//! also measured in interleaved batches ([`Pairs`]: A B, B A, …, median of the
//! per-round ratios, wall and CPU time), because criterion runs one benchmark after
//! another and on a shared machine the load changes in between. Workload 3 (hand-off latency) and 4 (Zipf)
//! also record their own per-operation samples across tasks with `Instant`, because
//! criterion's estimates are of a mean per iteration, not of a p99; their percentiles are
//! printed after each group. Workload 5 (memory) is not a timing: it runs each
//! implementation in a fresh child process (this same binary, re-executed with
//! `TKL_MEMPROBE` set) and reads the resident set size from `/proc/self/status`.
//!
//! Besides criterion's own output (`<target>/criterion/<group>/<bench>/new/*.json`), a
//! full run writes the pairs, percentiles and memory figures to
//! `<target>/criterion/tkl-custom/locks.jsonl`; `scripts/bench-charts` reads both.
//!
//! Allocations per operation are not counted here: a counting global allocator (dhat)
//! takes a global lock on every allocation and would distort the multi-task ratios.
//! `tests/allocations.rs` counts them (0 for a new or present `u64` key, 1 for a new
//! `String` key, 0 for a present one).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::hash::{BuildHasher, Hash, RandomState};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use dashmap::DashMap;
use tokio::runtime::Runtime;
use tokio::sync::{Mutex, OwnedMutexGuard, OwnedSemaphorePermit, Semaphore};
use tower_keyed_lock::{KeyGuard, KeyedLocks};

mod support;

use support::{criterion_dir, percentiles_f64, process_cpu_ns};

/// Keys cycled through by workload 1 (the issue's size).
const UNCONTENDED_KEYS: u64 = 1_000_000;
/// Tasks of workloads 2 and 4, on a runtime with 2 workers.
const TASKS: usize = 64;
/// Key spaces of workload 2.
const KEY_SPACES: [u64; 2] = [1_000, 100_000];
/// Tasks sharing the one hot key of workload 3.
const HANDOFF_TASKS: [usize; 3] = [2, 8, 64];
/// Workload 4: keys, Zipf exponent, critical section and wait timeout.
const ZIPF_KEYS: usize = 100_000;
const ZIPF_S: f64 = 1.1;
const ZIPF_HOLD: Duration = Duration::from_millis(1);
const ZIPF_TIMEOUT: Duration = Duration::from_millis(50);
/// Keys of workload 5 (the issue's size); `--test` uses 10 000.
const MEMORY_KEYS: u64 = 1_000_000;
/// Stripes of the `striped` baseline.
const STRIPES: usize = 4096;
/// The environment variable that turns this binary into a memory probe.
const MEMPROBE: &str = "TKL_MEMPROBE";

fn main() {
    if let Ok(spec) = std::env::var(MEMPROBE) {
        memory_probe(&spec);
        return;
    }
    let args = Args::parse();
    let mut c = Criterion::default()
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .configure_from_args();
    let mut report = Report::new(args.quick);

    uncontended(&mut c, &args, &mut report);
    contended(&mut c, &args, &mut report);
    handoff(&mut c, &mut report);
    zipf(&mut c, &mut report);
    if args.selected("5-memory") {
        memory(&args, &mut report);
    }
    withdraw(&mut c);

    c.final_summary();
    report.write("locks");
}

// ---------------------------------------------------------------------------------------
// The implementations under test.

/// A keyed lock as a benchmark sees it: owned guards, usable from spawned tasks.
trait Locks<K: Send + 'static>: Send + Sync + Sized + 'static {
    const NAME: &'static str;
    type Guard: Send + 'static;

    fn create() -> Self;

    fn lock(&self, key: K) -> impl Future<Output = Self::Guard> + Send + '_;

    /// `None` on timeout. Baselines wrap `lock` in `tokio::time::timeout`.
    fn lock_timeout(
        &self,
        key: K,
        timeout: Duration,
    ) -> impl Future<Output = Option<Self::Guard>> + Send + '_ {
        async move { tokio::time::timeout(timeout, self.lock(key)).await.ok() }
    }

    /// Entries in the table now (`None` when there is no table).
    fn entries(&self) -> Option<usize>;
}

/// What workloads 1–5 need of a key type.
trait BenchKey: Eq + Hash + Clone + Send + Sync + 'static {
    const TYPE: &'static str;
    fn make(i: u64) -> Self;
}

impl BenchKey for u64 {
    const TYPE: &'static str = "u64";
    fn make(i: u64) -> Self {
        i
    }
}

impl BenchKey for String {
    const TYPE: &'static str = "String";
    fn make(i: u64) -> Self {
        let mut key = String::with_capacity(16);
        write!(key, "order-{i}").expect("writing to a String");
        key
    }
}

impl<K: BenchKey> Locks<K> for KeyedLocks<K> {
    const NAME: &'static str = "keyed-locks";
    type Guard = KeyGuard<K>;

    fn create() -> Self {
        KeyedLocks::new()
    }

    fn lock(&self, key: K) -> impl Future<Output = Self::Guard> + Send + '_ {
        let acquire = KeyedLocks::lock(self, key);
        async move { acquire.await.expect("an unbounded table cannot refuse") }
    }

    fn lock_timeout(
        &self,
        key: K,
        timeout: Duration,
    ) -> impl Future<Output = Option<Self::Guard>> + Send + '_ {
        let acquire = KeyedLocks::lock_timeout(self, key, timeout);
        async move { acquire.await.ok() }
    }

    fn entries(&self) -> Option<usize> {
        Some(self.len())
    }
}

/// `diy-dashmap`: never removes an entry.
struct DiyDashMap<K>(DashMap<K, Arc<Mutex<()>>>);

impl<K: BenchKey> Locks<K> for DiyDashMap<K> {
    const NAME: &'static str = "diy-dashmap";
    type Guard = OwnedMutexGuard<()>;

    fn create() -> Self {
        Self(DashMap::new())
    }

    async fn lock(&self, key: K) -> Self::Guard {
        let mutex = self.0.entry(key).or_default().value().clone();
        mutex.lock_owned().await
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// `diy-dashmap-remove`: removes the entry on release when no one else has its `Arc`.
struct DiyDashMapRemove<K>(Arc<DashMap<K, Arc<Mutex<()>>>>);

struct DiyRemoveGuard<K: BenchKey> {
    map: Arc<DashMap<K, Arc<Mutex<()>>>>,
    key: K,
    guard: Option<OwnedMutexGuard<()>>,
}

impl<K: BenchKey> Drop for DiyRemoveGuard<K> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.map
            .remove_if(&self.key, |_, mutex| Arc::strong_count(mutex) == 1);
    }
}

impl<K: BenchKey> Locks<K> for DiyDashMapRemove<K> {
    const NAME: &'static str = "diy-dashmap-remove";
    type Guard = DiyRemoveGuard<K>;

    fn create() -> Self {
        Self(Arc::new(DashMap::new()))
    }

    async fn lock(&self, key: K) -> Self::Guard {
        let mutex = self.0.entry(key.clone()).or_default().value().clone();
        let guard = mutex.lock_owned().await;
        DiyRemoveGuard {
            map: self.0.clone(),
            key,
            guard: Some(guard),
        }
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.len())
    }
}

/// `mutex-hashmap`: one mutex over the whole map, a semaphore per key, with removal.
type SemaphoreMap<K> = StdMutex<HashMap<K, Arc<Semaphore>>>;

struct MutexHashMap<K>(Arc<SemaphoreMap<K>>);

struct MutexHashMapGuard<K: BenchKey> {
    map: Arc<SemaphoreMap<K>>,
    key: K,
    permit: Option<OwnedSemaphorePermit>,
}

impl<K: BenchKey> Drop for MutexHashMapGuard<K> {
    fn drop(&mut self) {
        drop(self.permit.take());
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if map
            .get(&self.key)
            .is_some_and(|semaphore| Arc::strong_count(semaphore) == 1)
        {
            map.remove(&self.key);
        }
    }
}

impl<K: BenchKey> Locks<K> for MutexHashMap<K> {
    const NAME: &'static str = "mutex-hashmap";
    type Guard = MutexHashMapGuard<K>;

    fn create() -> Self {
        Self(Arc::default())
    }

    async fn lock(&self, key: K) -> Self::Guard {
        let semaphore = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(1)))
            .clone();
        let permit = semaphore.acquire_owned().await.expect("never closed");
        MutexHashMapGuard {
            map: self.0.clone(),
            key,
            permit: Some(permit),
        }
    }

    fn entries(&self) -> Option<usize> {
        Some(self.0.lock().unwrap_or_else(|e| e.into_inner()).len())
    }
}

/// `striped`: a fixed array of mutexes chosen by hash.
struct Striped {
    stripes: Box<[Arc<Mutex<()>>]>,
    hasher: RandomState,
}

impl<K: BenchKey> Locks<K> for Striped {
    const NAME: &'static str = "striped";
    type Guard = OwnedMutexGuard<()>;

    fn create() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| Arc::default()).collect(),
            hasher: RandomState::new(),
        }
    }

    fn lock(&self, key: K) -> impl Future<Output = Self::Guard> + Send + '_ {
        let stripe = self.hasher.hash_one(&key) as usize & (STRIPES - 1);
        self.stripes[stripe].clone().lock_owned()
    }

    fn entries(&self) -> Option<usize> {
        None
    }
}

// ---------------------------------------------------------------------------------------
// Workload 1: uncontended distinct keys, one task.

fn uncontended(c: &mut Criterion, args: &Args, report: &mut Report) {
    let mut group = c.benchmark_group("1-uncontended");
    group.throughput(Throughput::Elements(1));
    let prefill = !args.quick && args.selected("1-uncontended");
    uncontended_key::<u64>(&mut group, prefill);
    uncontended_key::<String>(&mut group, prefill);
    group.finish();

    if args.selected("1-uncontended-paired") {
        let mut pairs = Pairs::new("1-uncontended-paired", args);
        pairs.run(
            "u64",
            uncontended_batch::<u64, DiyDashMapRemove<u64>>(),
            uncontended_batch::<u64, KeyedLocks<u64>>(),
            100_000,
        );
        pairs.run(
            "String",
            uncontended_batch::<String, DiyDashMapRemove<String>>(),
            uncontended_batch::<String, KeyedLocks<String>>(),
            100_000,
        );
        pairs.finish(report);
    }
}

/// A batch of workload 1 for [`Pairs`]: `ops` lock–release operations on keys made
/// before the clock starts.
fn uncontended_batch<K: BenchKey, L: Locks<K>>() -> (&'static str, impl FnMut(u64) -> Sample) {
    let locks = L::create();
    let mut next = 0;
    let batch = move |ops: u64| {
        let keys: Vec<K> = (0..ops)
            .map(|_| {
                next = (next + 1) % UNCONTENDED_KEYS;
                K::make(next)
            })
            .collect();
        Sample::measure(|| {
            for key in keys {
                drop(poll_now(locks.lock(key)));
            }
        })
    };
    (L::NAME, batch)
}

fn uncontended_key<K: BenchKey>(group: &mut Group<'_>, prefill: bool) {
    uncontended_one::<K, KeyedLocks<K>>(group, prefill);
    uncontended_one::<K, DiyDashMap<K>>(group, prefill);
    uncontended_one::<K, DiyDashMapRemove<K>>(group, prefill);
    uncontended_one::<K, MutexHashMap<K>>(group, prefill);
    uncontended_one::<K, Striped>(group, prefill);

    // The layer's own fast path: `try_lock`, no future.
    let locks = KeyedLocks::<K>::new();
    let mut next = 0;
    group.bench_function(BenchmarkId::new("keyed-locks-try_lock", K::TYPE), |b| {
        b.iter_batched(
            || {
                next = (next + 1) % UNCONTENDED_KEYS;
                K::make(next)
            },
            |key| drop(locks.try_lock(key).expect("uncontended")),
            BatchSize::SmallInput,
        )
    });
}

fn uncontended_one<K: BenchKey, L: Locks<K>>(group: &mut Group<'_>, prefill: bool) {
    let locks = L::create();
    if prefill {
        // `diy-dashmap` reaches its steady state (every key present) before it is timed.
        for i in 0..UNCONTENDED_KEYS {
            drop(poll_now(locks.lock(K::make(i))));
        }
    }
    let mut next = 0;
    group.bench_function(BenchmarkId::new(L::NAME, K::TYPE), |b| {
        // The key is made outside the timed region; every implementation takes it by
        // value, as a middleware that extracted it from a request would pass it.
        b.iter_batched(
            || {
                next = (next + 1) % UNCONTENDED_KEYS;
                K::make(next)
            },
            |key| drop(poll_now(locks.lock(key))),
            BatchSize::SmallInput,
        )
    });
}

/// Polls an uncontended lock future once; it must be ready.
fn poll_now<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("an uncontended lock did not resolve at once"),
    }
}

type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

// ---------------------------------------------------------------------------------------
// Workload 2: 64 tasks on 2 workers, each lock held across one `yield_now()`.

fn contended(c: &mut Criterion, args: &Args, report: &mut Report) {
    let rt = Arc::new(runtime());
    let mut group = c.benchmark_group("2-contended");
    group.throughput(Throughput::Elements(1));
    for key_space in KEY_SPACES {
        contended_one::<KeyedLocks<u64>>(&mut group, &rt, key_space);
        contended_one::<DiyDashMap<u64>>(&mut group, &rt, key_space);
        contended_one::<DiyDashMapRemove<u64>>(&mut group, &rt, key_space);
        contended_one::<MutexHashMap<u64>>(&mut group, &rt, key_space);
        contended_one::<Striped>(&mut group, &rt, key_space);
    }
    group.finish();

    if args.selected("2-contended-paired") {
        let mut pairs = Pairs::new("2-contended-paired", args);
        for key_space in KEY_SPACES {
            let space = key_space.to_string();
            // Calibration: two tables of the same kind. Their ratio is not exactly 1
            // (where each table's hot fields fall in cache lines differs), which bounds
            // what the other ratios can resolve.
            pairs.run(
                &space,
                contended_batch::<KeyedLocks<u64>>(&rt, key_space),
                contended_batch::<KeyedLocks<u64>>(&rt, key_space),
                200_000,
            );
            pairs.run(
                &space,
                contended_batch::<DiyDashMap<u64>>(&rt, key_space),
                contended_batch::<KeyedLocks<u64>>(&rt, key_space),
                200_000,
            );
            pairs.run(
                &space,
                contended_batch::<DiyDashMapRemove<u64>>(&rt, key_space),
                contended_batch::<KeyedLocks<u64>>(&rt, key_space),
                200_000,
            );
        }
        pairs.finish(report);
    }
}

/// A batch of workload 2 for [`Pairs`].
fn contended_batch<L: Locks<u64>>(
    rt: &Arc<Runtime>,
    key_space: u64,
) -> (&'static str, impl FnMut(u64) -> Sample) {
    let locks = Arc::new(L::create());
    let rt = rt.clone();
    let batch =
        move |ops| Sample::measure(|| rt.block_on(contended_run(locks.clone(), ops, key_space)));
    (L::NAME, batch)
}

fn contended_one<L: Locks<u64>>(group: &mut Group<'_>, rt: &Runtime, key_space: u64) {
    let locks = Arc::new(L::create());
    group.bench_function(BenchmarkId::new(L::NAME, key_space), |b| {
        b.iter_custom(|ops| rt.block_on(contended_run(locks.clone(), ops, key_space)))
    });
}

/// `ops` lock–yield–release operations on random keys, shared among [`TASKS`] tasks.
async fn contended_run<L: Locks<u64>>(locks: Arc<L>, ops: u64, key_space: u64) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let locks = locks.clone();
            tokio::spawn(async move {
                let mut rng = Rng::new(task as u64);
                for _ in 0..share(ops, task, TASKS) {
                    let guard = locks.lock(rng.below(key_space)).await;
                    tokio::task::yield_now().await;
                    drop(guard);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("benchmark task panicked");
    }
    start.elapsed()
}

// ---------------------------------------------------------------------------------------
// Workload 6: withdrawing queued waiters of one hot key (issue 11.6).

/// Waiters queued on the one key before each timed round of withdrawals.
const WITHDRAW_QUEUE: usize = 10_000;

/// Time per withdrawal of a queued waiter (a dropped lock future), oldest-first and
/// newest-first; each must be constant, whatever the queue length and the order.
fn withdraw(c: &mut Criterion) {
    let mut group = c.benchmark_group("6-withdraw");
    group.throughput(Throughput::Elements(1));
    type Arrange = fn(&mut Vec<tower_keyed_lock::Acquire<u64>>);
    let orders: [(&str, Arrange); 2] = [
        ("oldest-first", |_| {}),
        ("newest-first", |waiters| waiters.reverse()),
    ];
    for (order, arrange) in orders {
        group.bench_function(BenchmarkId::new(order, WITHDRAW_QUEUE), |b| {
            b.iter_custom(|withdrawals| {
                let locks = KeyedLocks::<u64>::new();
                let _holder = locks.try_lock(0).expect("a fresh table");
                let mut elapsed = Duration::ZERO;
                let mut left = withdrawals as usize;
                while left > 0 {
                    let round = left.min(WITHDRAW_QUEUE);
                    let mut waiters: Vec<_> = (0..round)
                        .map(|_| {
                            let mut waiter = locks.lock(0);
                            let polled =
                                Pin::new(&mut waiter).poll(&mut Context::from_waker(Waker::noop()));
                            assert!(polled.is_pending(), "the key is held");
                            waiter
                        })
                        .collect();
                    arrange(&mut waiters);
                    let start = Instant::now();
                    drop(waiters); // front to back
                    elapsed += start.elapsed();
                    left -= round;
                }
                elapsed
            })
        });
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------
// Workload 3: hot-key hand-off.

fn handoff(c: &mut Criterion, report: &mut Report) {
    let rt = runtime();
    let mut group = c.benchmark_group("3-handoff");
    group.throughput(Throughput::Elements(1));
    let mut results = Vec::new();
    for tasks in HANDOFF_TASKS {
        results.push(handoff_one::<KeyedLocks<u64>>(&mut group, &rt, tasks));
        results.push(handoff_one::<DiyDashMapRemove<u64>>(&mut group, &rt, tasks));
        results.push(handoff_one::<MutexHashMap<u64>>(&mut group, &rt, tasks));
    }
    group.finish();
    if results.iter().all(|(_, _, samples)| samples.is_empty()) {
        return; // filtered out, or `--test` with one acquisition each
    }

    let mut table = String::from(
        "\n3-handoff: release -> next holder running (own samples across tasks)\n\
         tasks  implementation        samples     p50 ns     p90 ns     p99 ns\n",
    );
    for (name, tasks, mut samples) in results {
        let [p50, p90, p99] = percentiles(&mut samples, [0.5, 0.9, 0.99]);
        let _ = writeln!(
            table,
            "{tasks:>5}  {name:<20} {:>8} {p50:>10} {p90:>10} {p99:>10}",
            samples.len()
        );
        report.push(format!(
            r#"{{"workload":"3-handoff","impl":"{name}","tasks":{tasks},"samples":{},"p50_ns":{p50},"p90_ns":{p90},"p99_ns":{p99}}}"#,
            samples.len()
        ));
    }
    println!("{table}");
}

fn handoff_one<L: Locks<u64>>(
    group: &mut Group<'_>,
    rt: &Runtime,
    tasks: usize,
) -> (&'static str, usize, Vec<u64>) {
    let locks = Arc::new(L::create());
    let mut samples = Vec::new();
    group.bench_function(BenchmarkId::new(L::NAME, tasks), |b| {
        b.iter_custom(|ops| {
            let (elapsed, latencies) = rt.block_on(handoff_run(locks.clone(), tasks, ops));
            samples.extend(latencies);
            elapsed
        })
    });
    (L::NAME, tasks, samples)
}

/// `ops` acquisitions of one key by `tasks` tasks, each holding it across one
/// `yield_now()`. Returns the wall time and, for every acquisition that followed a
/// release, the nanoseconds from that release to the new holder running.
async fn handoff_run<L: Locks<u64>>(locks: Arc<L>, tasks: usize, ops: u64) -> (Duration, Vec<u64>) {
    const HOT: u64 = 42;
    let base = Instant::now();
    // When the last holder released (ns since `base`, + 1), or 0 if it was consumed.
    // The lock orders the store before the next holder's swap, so `Relaxed` suffices.
    let released = Arc::new(AtomicU64::new(0));
    let tickets = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let (locks, released, tickets) = (locks.clone(), released.clone(), tickets.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while tickets.fetch_add(1, Ordering::Relaxed) < ops {
                    let guard = locks.lock(HOT).await;
                    let now = base.elapsed().as_nanos() as u64 + 1;
                    let release = released.swap(0, Ordering::Relaxed);
                    if release != 0 {
                        latencies.push(now.saturating_sub(release));
                    }
                    tokio::task::yield_now().await;
                    released.store(base.elapsed().as_nanos() as u64 + 1, Ordering::Relaxed);
                    drop(guard);
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for handle in handles {
        latencies.extend(handle.await.expect("benchmark task panicked"));
    }
    (base.elapsed(), latencies)
}

// ---------------------------------------------------------------------------------------
// Workload 4: Zipf-distributed keys, 1 ms critical section, wait timeout.

fn zipf(c: &mut Criterion, report: &mut Report) {
    let rt = runtime();
    let zipf = Arc::new(Zipf::new(ZIPF_KEYS, ZIPF_S));
    let mut group = c.benchmark_group("4-zipf");
    group
        .throughput(Throughput::Elements(1))
        .sample_size(10)
        .measurement_time(Duration::from_secs(3));
    let results = vec![
        zipf_one::<KeyedLocks<u64>>(&mut group, &rt, &zipf),
        zipf_one::<DiyDashMap<u64>>(&mut group, &rt, &zipf),
        zipf_one::<DiyDashMapRemove<u64>>(&mut group, &rt, &zipf),
        zipf_one::<MutexHashMap<u64>>(&mut group, &rt, &zipf),
        zipf_one::<Striped>(&mut group, &rt, &zipf),
    ];
    group.finish();
    if results.iter().all(|(_, totals, _)| totals.attempts == 0) {
        return; // filtered out
    }

    let mut table = format!(
        "\n4-zipf: {TASKS} tasks, {ZIPF_KEYS} keys, s = {ZIPF_S}, hold {ZIPF_HOLD:?}, \
         timeout {ZIPF_TIMEOUT:?} (own counters)\n\
         implementation        attempts  acquired/s  timeouts  p50 wait us  p99 wait us  entries left\n"
    );
    for (name, mut totals, entries) in results {
        let secs = totals.elapsed.as_secs_f64().max(1e-9);
        let acquired = totals.waits_us.len() as u64;
        let rate = acquired as f64 / secs;
        let timeout_rate = totals.timeouts as f64 / totals.attempts.max(1) as f64;
        let [p50, p99] = percentiles(&mut totals.waits_us, [0.5, 0.99]);
        let entries = entries.map_or("-".to_owned(), |n| n.to_string());
        let _ = writeln!(
            table,
            "{name:<20} {:>9} {rate:>11.0} {:>8.2}% {p50:>12} {p99:>12} {entries:>13}",
            totals.attempts,
            timeout_rate * 100.0
        );
        report.push(format!(
            r#"{{"workload":"4-zipf","impl":"{name}","attempts":{},"acquired_per_s":{rate:.1},"timeout_rate":{timeout_rate:.6},"p50_wait_us":{p50},"p99_wait_us":{p99},"entries_left":"{entries}"}}"#,
            totals.attempts
        ));
    }
    println!("{table}");
}

#[derive(Default)]
struct ZipfTotals {
    attempts: u64,
    timeouts: u64,
    /// Waits of the attempts that acquired, in microseconds.
    waits_us: Vec<u64>,
    elapsed: Duration,
}

fn zipf_one<L: Locks<u64>>(
    group: &mut Group<'_>,
    rt: &Runtime,
    zipf: &Arc<Zipf>,
) -> (&'static str, ZipfTotals, Option<usize>) {
    let locks = Arc::new(L::create());
    let mut totals = ZipfTotals::default();
    group.bench_function(BenchmarkId::new(L::NAME, "s1.1"), |b| {
        b.iter_custom(|ops| {
            let run = rt.block_on(zipf_run(locks.clone(), zipf.clone(), ops));
            totals.attempts += ops;
            totals.timeouts += run.timeouts;
            totals.waits_us.extend(run.waits_us);
            totals.elapsed += run.elapsed;
            run.elapsed
        })
    });
    (L::NAME, totals, locks.entries())
}

async fn zipf_run<L: Locks<u64>>(locks: Arc<L>, zipf: Arc<Zipf>, ops: u64) -> ZipfTotals {
    let start = Instant::now();
    let seed = start.elapsed().as_nanos() as u64 ^ ops;
    let handles: Vec<_> = (0..TASKS)
        .map(|task| {
            let (locks, zipf) = (locks.clone(), zipf.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(seed.wrapping_add(task as u64));
                let (mut timeouts, mut waits) = (0, Vec::new());
                for _ in 0..share(ops, task, TASKS) {
                    let key = zipf.sample(rng.unit());
                    let asked = Instant::now();
                    match locks.lock_timeout(key, ZIPF_TIMEOUT).await {
                        Some(guard) => {
                            waits.push(asked.elapsed().as_micros() as u64);
                            tokio::time::sleep(ZIPF_HOLD).await;
                            drop(guard);
                        }
                        None => timeouts += 1,
                    }
                }
                (timeouts, waits)
            })
        })
        .collect();
    let mut totals = ZipfTotals::default();
    for handle in handles {
        let (timeouts, waits) = handle.await.expect("benchmark task panicked");
        totals.timeouts += timeouts;
        totals.waits_us.extend(waits);
    }
    totals.elapsed = start.elapsed();
    totals
}

/// Ranks 0..n drawn with probability proportional to 1 / (rank + 1)^s.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut total = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|rank| {
                total += (rank as f64).powf(-s);
                total
            })
            .collect();
        for p in &mut cdf {
            *p /= total;
        }
        Self { cdf }
    }

    /// The rank for a uniform `u` in [0, 1).
    fn sample(&self, u: f64) -> u64 {
        self.cdf.partition_point(|&p| p < u).min(self.cdf.len() - 1) as u64
    }
}

// ---------------------------------------------------------------------------------------
// Workload 5: memory, measured in fresh child processes.

fn memory(args: &Args, report: &mut Report) {
    let keys = if args.quick { 10_000 } else { MEMORY_KEYS };
    let impls = [
        <KeyedLocks<u64> as Locks<u64>>::NAME,
        <DiyDashMap<u64> as Locks<u64>>::NAME,
        <DiyDashMapRemove<u64> as Locks<u64>>::NAME,
        <MutexHashMap<u64> as Locks<u64>>::NAME,
    ];
    let mut churn = format!(
        "\n5-memory: {keys} keys locked and released one after another; every 10th key \
         also gets a waiter\nthat is cancelled (half while queued, half after the \
         release handed it the lock)\n\
         implementation        RSS before kB  RSS after kB  growth kB  entries left\n"
    );
    let mut held = format!(
        "\n5-memory: {keys} guards held at once, then all released\n\
         implementation        key     RSS before kB  held kB  B/key total  \
         B/key table  after release kB  entries left\n"
    );
    for name in impls {
        let [before, after, entries, ..] = run_probe("churn", name, "u64", keys);
        let _ = writeln!(
            churn,
            "{name:<20} {before:>14} {after:>13} {:>10} {entries:>13}",
            after as i64 - before as i64
        );
        report.push(format!(
            r#"{{"workload":"5-memory-churn","impl":"{name}","keys":{keys},"rss_before_kb":{before},"rss_after_kb":{after},"entries_left":{entries}}}"#
        ));
        for key in ["u64", "String"] {
            let [before, held_kb, released, guard_bytes, entries] =
                run_probe("held", name, key, keys);
            let total = (held_kb as f64 - before as f64) * 1024.0 / keys as f64;
            let table = total - guard_bytes as f64 / keys as f64;
            let _ = writeln!(
                held,
                "{name:<20} {key:<7} {before:>13} {held_kb:>8} {total:>12.1} {table:>12.1} {released:>17} {entries:>13}",
            );
            report.push(format!(
                r#"{{"workload":"5-memory-held","impl":"{name}","key":"{key}","keys":{keys},"rss_before_kb":{before},"rss_held_kb":{held_kb},"bytes_per_key_total":{total:.1},"bytes_per_key_table":{table:.1},"rss_after_release_kb":{released}}}"#
            ));
        }
    }
    println!("{churn}{held}");
}

/// Runs this binary as a probe; returns the five numbers it prints.
fn run_probe(phase: &str, name: &str, key: &str, keys: u64) -> [u64; 5] {
    let exe = std::env::current_exe().expect("the benchmark binary's path");
    let output = std::process::Command::new(exe)
        .env(MEMPROBE, format!("{phase} {name} {key} {keys}"))
        .output()
        .expect("running the memory probe");
    assert!(
        output.status.success(),
        "memory probe {phase} {name} {key} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix("MEMPROBE "))
        .expect("the probe prints one MEMPROBE line");
    let mut numbers = line.split(' ').map(|n| n.parse().expect("a number"));
    std::array::from_fn(|_| numbers.next().expect("five numbers"))
}

/// The child side: `TKL_MEMPROBE="<churn|held> <impl> <u64|String> <keys>"`.
fn memory_probe(spec: &str) {
    let parts: Vec<&str> = spec.split(' ').collect();
    let [phase, name, key, keys] = parts[..] else {
        panic!("{MEMPROBE}: expected `phase impl key keys`, got {spec:?}");
    };
    let keys: u64 = keys.parse().expect("a key count");
    let numbers = match key {
        "u64" => probe_key::<u64>(phase, name, keys),
        "String" => probe_key::<String>(phase, name, keys),
        other => panic!("unknown key type {other}"),
    };
    let numbers: Vec<String> = numbers.iter().map(u64::to_string).collect();
    println!("MEMPROBE {}", numbers.join(" "));
}

fn probe_key<K: BenchKey>(phase: &str, name: &str, keys: u64) -> [u64; 5] {
    match name {
        "keyed-locks" => probe::<K, KeyedLocks<K>>(phase, keys),
        "diy-dashmap" => probe::<K, DiyDashMap<K>>(phase, keys),
        "diy-dashmap-remove" => probe::<K, DiyDashMapRemove<K>>(phase, keys),
        "mutex-hashmap" => probe::<K, MutexHashMap<K>>(phase, keys),
        other => panic!("no memory probe for {other}"),
    }
}

/// `churn`: RSS before, RSS after, entries left. `held`: RSS before, while held and
/// after release, the bytes of the guards themselves, entries left after release.
fn probe<K: BenchKey, L: Locks<K>>(phase: &str, keys: u64) -> [u64; 5] {
    let locks = L::create();
    match phase {
        "churn" => {
            for i in 0..1_000 {
                drop(poll_now(locks.lock(K::make(u64::MAX - i))));
            }
            let before = rss_kb();
            for i in 0..keys {
                let guard = poll_now(locks.lock(K::make(i)));
                if i % 10 != 0 {
                    drop(guard);
                    continue;
                }
                let mut waiter: Pin<Box<_>> = Box::pin(locks.lock(K::make(i)));
                let polled = waiter
                    .as_mut()
                    .poll(&mut Context::from_waker(Waker::noop()));
                assert!(polled.is_pending(), "a held key was acquired twice");
                if i % 20 == 0 {
                    // Cancelled while queued.
                    drop(waiter);
                    drop(guard);
                } else {
                    // Cancelled after the release handed it the lock, before it ran.
                    drop(guard);
                    drop(waiter);
                }
            }
            let after = rss_kb();
            let entries = locks.entries().unwrap_or(0) as u64;
            [before, after, entries, 0, 0]
        }
        "held" => {
            let mut guards = Vec::with_capacity(keys as usize);
            let before = rss_kb();
            for i in 0..keys {
                guards.push(poll_now(locks.lock(K::make(i))));
            }
            let held = rss_kb();
            let guard_bytes = (guards.len() * std::mem::size_of::<L::Guard>()) as u64;
            assert_eq!(locks.entries(), Some(keys as usize));
            drop(guards);
            let released = rss_kb();
            let entries = locks.entries().unwrap_or(0) as u64;
            [before, held, released, guard_bytes, entries]
        }
        other => panic!("unknown phase {other}"),
    }
}

/// Resident set size of this process, in kB.
fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line")
}

// ---------------------------------------------------------------------------------------
// Interleaved pairs: the ratios the targets are judged by.

/// Runs two implementations in alternating batches (A B, then B A, …) so that a change
/// in machine load hits both alike, and keeps the median of the per-round ratios, of
/// wall time and of CPU time.
///
/// Criterion measures one benchmark after another; on a loaded machine the load can
/// change between them. These pairs are the side-by-side measurement of the targets.
/// CPU time (the on-CPU time of every thread of the process, from
/// `/proc/self/task/*/schedstat`) leaves out the time other processes ran on the
/// cores, which wall time on a shared machine does not.
struct Pairs {
    section: &'static str,
    rounds: usize,
    quick: bool,
    rows: Vec<String>,
    json: Vec<String>,
}

impl Pairs {
    fn new(section: &'static str, args: &Args) -> Self {
        Self {
            section,
            rounds: if args.quick { 1 } else { 31 },
            quick: args.quick,
            rows: Vec::new(),
            json: Vec::new(),
        }
    }

    /// `base` and `subject` each run `ops` operations per batch and return the time.
    fn run(
        &mut self,
        param: &str,
        (base_name, mut base): (&'static str, impl FnMut(u64) -> Sample),
        (name, mut subject): (&'static str, impl FnMut(u64) -> Sample),
        ops: u64,
    ) {
        let ops = if self.quick { 64 } else { ops };
        // One untimed batch each: caches, table capacity, lazily started workers.
        base(ops);
        subject(ops);
        let (mut base_ns, mut subject_ns) = (Vec::new(), Vec::new());
        let (mut base_cpu, mut subject_cpu) = (Vec::new(), Vec::new());
        let (mut ratios, mut cpu_ratios) = (Vec::new(), Vec::new());
        for round in 0..self.rounds {
            let (b, s) = if round % 2 == 0 {
                let b = base(ops);
                (b, subject(ops))
            } else {
                let s = subject(ops);
                (base(ops), s)
            };
            let per_op = |ns: f64| ns / ops as f64;
            base_ns.push(per_op(b.wall.as_nanos() as f64));
            subject_ns.push(per_op(s.wall.as_nanos() as f64));
            base_cpu.push(per_op(b.cpu_ns as f64));
            subject_cpu.push(per_op(s.cpu_ns as f64));
            ratios.push(s.wall.as_secs_f64() / b.wall.as_secs_f64());
            cpu_ratios.push(s.cpu_ns as f64 / b.cpu_ns.max(1) as f64);
        }
        let [b] = percentiles_f64(&mut base_ns, [0.5]);
        let [s] = percentiles_f64(&mut subject_ns, [0.5]);
        let [bc] = percentiles_f64(&mut base_cpu, [0.5]);
        let [sc] = percentiles_f64(&mut subject_cpu, [0.5]);
        let [r10, r50, r90] = percentiles_f64(&mut ratios, [0.1, 0.5, 0.9]);
        let [c10, c50, c90] = percentiles_f64(&mut cpu_ratios, [0.1, 0.5, 0.9]);
        // Cores busy on average: about 1 when the other core was taken by other work.
        let par = (sc + bc) / (s + b);
        self.rows.push(format!(
            "{param:>8}  {name:<12} vs {base_name:<19} {s:>8.1} {b:>8.1} {r50:>6.3} [{r10:.2}–{r90:.2}] \
             {sc:>8.1} {bc:>8.1} {c50:>6.3} [{c10:.2}–{c90:.2}] {par:>5.2}"
        ));
        self.json.push(format!(
            r#"{{"workload":"{}","param":"{param}","impl":"{name}","base":"{base_name}","rounds":{},"ops_per_batch":{ops},"ns_per_op":{s:.2},"base_ns_per_op":{b:.2},"time_ratio_p50":{r50:.4},"time_ratio_p10":{r10:.4},"time_ratio_p90":{r90:.4},"cpu_ns_per_op":{sc:.2},"base_cpu_ns_per_op":{bc:.2},"cpu_ratio_p50":{c50:.4},"cpu_ratio_p10":{c10:.4},"cpu_ratio_p90":{c90:.4},"cores_busy":{par:.3}}}"#,
            self.section, self.rounds
        ));
    }

    fn finish(self, report: &mut Report) {
        println!(
            "\n{}: {} interleaved rounds; per op: medians of wall and CPU time, and the \
             median of the\nper-round ratios subject / base (< 1: subject faster) with \
             p10–p90; cores: CPU / wall time\n\
             {:>8}  {:<35} {:>8} {:>8} {:>6} {:>11} {:>8} {:>8} {:>6} {:>11} {:>5}",
            self.section,
            self.rounds,
            "param",
            "subject vs base",
            "wall ns",
            "base",
            "ratio",
            "",
            "cpu ns",
            "base",
            "ratio",
            "",
            "cores"
        );
        for row in &self.rows {
            println!("{row}");
        }
        println!();
        for line in self.json {
            report.push(line);
        }
    }
}

/// One batch: its wall time and the CPU time all threads of the process spent in it.
struct Sample {
    wall: Duration,
    cpu_ns: u64,
}

impl Sample {
    fn measure<R>(f: impl FnOnce() -> R) -> Self {
        let cpu = process_cpu_ns();
        let start = Instant::now();
        drop(f());
        let wall = start.elapsed();
        Self {
            wall,
            cpu_ns: process_cpu_ns().saturating_sub(cpu),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Helpers.

/// The multi-threaded runtime of workloads 2–4: 2 workers, as on the CI machines.
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Task `task`'s share of `ops` operations split among `tasks` tasks.
fn share(ops: u64, task: usize, tasks: usize) -> u64 {
    ops / tasks as u64 + u64::from((task as u64) < ops % tasks as u64)
}

/// The values at quantiles `qs` (nearest rank), 0 for no samples. Sorts `samples`.
fn percentiles<const N: usize>(samples: &mut [u64], qs: [f64; N]) -> [u64; N] {
    samples.sort_unstable();
    qs.map(|q| match samples.len() {
        0 => 0,
        n => samples[((n - 1) as f64 * q).round() as usize],
    })
}

/// SplitMix64: small, fast and good enough to pick keys.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The command line, as far as this file needs it: test mode and name filters.
struct Args {
    quick: bool,
    filters: Vec<String>,
    exact: bool,
    list: bool,
}

impl Args {
    fn parse() -> Self {
        // Criterion options that take a value, whose value is not a filter.
        const VALUED: &[&str] = &[
            "--save-baseline",
            "--baseline",
            "--baseline-lenient",
            "--load-baseline",
            "--sample-size",
            "--warm-up-time",
            "--measurement-time",
            "--nresamples",
            "--noise-threshold",
            "--confidence-level",
            "--significance-level",
            "--profile-time",
            "--plotting-backend",
            "--output-format",
            "--color",
            "--format",
            "-s",
            "-b",
            "-c",
        ];
        let args: Vec<String> = std::env::args().skip(1).collect();
        let mut filters = Vec::new();
        let mut skip = false;
        for arg in &args {
            if std::mem::take(&mut skip) {
                continue;
            }
            if arg.starts_with('-') {
                skip = VALUED.contains(&arg.as_str());
            } else {
                filters.push(arg.clone());
            }
        }
        let has = |flag: &str| args.iter().any(|a| a == flag);
        Self {
            // `cargo bench -p tower-keyed-lock-benches` passes `--bench`; `cargo bench -p tower-keyed-lock-benches -- --test` and
            // `cargo test --benches` run each benchmark once.
            quick: has("--test") || !has("--bench"),
            filters,
            exact: has("--exact"),
            list: has("--list"),
        }
    }

    /// Whether a section named `name` passes the command line's filters.
    fn selected(&self, name: &str) -> bool {
        !self.list
            && (self.filters.is_empty()
                || self.filters.iter().any(|f| match self.exact {
                    true => f == name,
                    false => name.contains(f.as_str()),
                }))
    }
}

/// Percentiles and memory figures of a full run, for `scripts/bench-charts`.
struct Report {
    quick: bool,
    lines: Vec<String>,
}

impl Report {
    fn new(quick: bool) -> Self {
        Self {
            quick,
            lines: Vec::new(),
        }
    }

    fn push(&mut self, line: String) {
        self.lines.push(line);
    }

    /// Writes `<criterion dir>/tkl-custom/<bench>.jsonl` (not in test mode), keeping
    /// the lines of workloads this run did not measure (a filtered run updates its part).
    fn write(&self, bench: &str) {
        if self.quick || self.lines.is_empty() {
            return;
        }
        fn workload(line: &str) -> Option<&str> {
            let rest = line.split_once(r#""workload":""#)?.1;
            Some(rest.split_once('"')?.0)
        }
        let dir = criterion_dir().join("tkl-custom");
        let path = dir.join(format!("{bench}.jsonl"));
        let fresh: Vec<&str> = self.lines.iter().filter_map(|l| workload(l)).collect();
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        let kept = old
            .lines()
            .filter(|line| workload(line).is_some_and(|w| !fresh.contains(&w)));
        let mut text = String::new();
        for line in kept.chain(self.lines.iter().map(String::as_str)) {
            text.push_str(line);
            text.push('\n');
        }
        match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
            Ok(()) => println!("custom results written to {}", path.display()),
            Err(error) => eprintln!("could not write {}: {error}", path.display()),
        }
    }
}
