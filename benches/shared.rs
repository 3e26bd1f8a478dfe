//! Shared (reader) locks in process: [`KeyedLocks::lock_shared`] against the exclusive
//! `lock` of the same table, and against what users write themselves for a keyed
//! reader/writer lock, `DashMap<K, Arc<tokio::sync::RwLock<()>>>` (`diy-dashmap-rwlock`,
//! which never removes an entry: the speed ceiling, leaking one entry per key ever used).
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench shared            # full run (about a minute)
//! cargo bench -p tower-keyed-lock-benches --bench shared -- --test  # CI: each benchmark once
//! ```
//!
//! - `7-shared-uncontended`: one task locks and releases keys cycled over 1 000, each
//!   free: the cost of the shared path itself.
//! - `8-read-heavy`: 64 tasks on 2 worker threads, 64 hot keys, 9 reads to 1 write, each
//!   holding across one yield; time per 10 000 operations.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dashmap::DashMap;
use tokio::sync::RwLock;
use tower_keyed_lock::KeyedLocks;

const KEYS: u64 = 1_000;
const TASKS: u64 = 64;
const HOT_KEYS: u64 = 64;
const OPS: u64 = 10_000;

/// Polls a future that is ready at once (an uncontended lock) without a runtime.
fn poll_now<F: Future>(future: F) -> F::Output {
    match pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("an uncontended lock waited"),
    }
}

type DiyRwLocks = DashMap<u64, Arc<RwLock<()>>>;

fn uncontended(c: &mut Criterion) {
    let mut group = c.benchmark_group("7-shared-uncontended");
    group.throughput(Throughput::Elements(1));
    let locks = KeyedLocks::<u64>::new();
    let mut key = 0;
    group.bench_function("keyed-locks-lock", |b| {
        b.iter(|| {
            key = (key + 1) % KEYS;
            drop(poll_now(locks.lock(key)).unwrap());
        })
    });
    group.bench_function("keyed-locks-lock_shared", |b| {
        b.iter(|| {
            key = (key + 1) % KEYS;
            drop(poll_now(locks.lock_shared(key)).unwrap());
        })
    });
    let diy = DiyRwLocks::new();
    group.bench_function("diy-dashmap-rwlock-read", |b| {
        b.iter(|| {
            key = (key + 1) % KEYS;
            let lock = diy.entry(key).or_default().value().clone();
            drop(poll_now(lock.read_owned()));
        })
    });
    group.finish();
}

/// The operation of task `task` at step `step`: a write one time in ten.
fn is_write(task: u64, step: u64) -> bool {
    (task * 7 + step).is_multiple_of(10)
}

async fn read_heavy_keyed(locks: KeyedLocks<u64>) -> Duration {
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let locks = locks.clone();
            tokio::spawn(async move {
                for step in 0..OPS / TASKS {
                    let key = (task * 31 + step) % HOT_KEYS;
                    let guard = match is_write(task, step) {
                        true => locks.lock(key).await.unwrap(),
                        false => locks.lock_shared(key).await.unwrap(),
                    };
                    tokio::task::yield_now().await;
                    drop(guard);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    started.elapsed()
}

async fn read_heavy_diy(locks: Arc<DiyRwLocks>) -> Duration {
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let locks = locks.clone();
            tokio::spawn(async move {
                for step in 0..OPS / TASKS {
                    let key = (task * 31 + step) % HOT_KEYS;
                    let lock = locks.entry(key).or_default().value().clone();
                    if is_write(task, step) {
                        let guard = lock.write_owned().await;
                        tokio::task::yield_now().await;
                        drop(guard);
                    } else {
                        let guard = lock.read_owned().await;
                        tokio::task::yield_now().await;
                        drop(guard);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    started.elapsed()
}

fn read_heavy(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let mut group = c.benchmark_group("8-read-heavy");
    group.throughput(Throughput::Elements(OPS));
    group.bench_function(BenchmarkId::new("keyed-locks", HOT_KEYS), |b| {
        b.iter_custom(|rounds| {
            let locks = KeyedLocks::new();
            (0..rounds)
                .map(|_| runtime.block_on(read_heavy_keyed(locks.clone())))
                .sum()
        })
    });
    group.bench_function(BenchmarkId::new("diy-dashmap-rwlock", HOT_KEYS), |b| {
        b.iter_custom(|rounds| {
            let locks = Arc::new(DiyRwLocks::new());
            (0..rounds)
                .map(|_| runtime.block_on(read_heavy_diy(locks.clone())))
                .sum()
        })
    });
    group.finish();
}

criterion_group!(benches, uncontended, read_heavy);
criterion_main!(benches);
