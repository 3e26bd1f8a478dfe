//! Multi-threaded stress of `KeyedLocks`: many tasks lock, time out, try and cancel on
//! a few hot keys; holders check the per-key permit bound, and at the end the table
//! must be empty with every key free (no leaked permit or entry).

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_keyed_lock::{KeyGuard, KeyedLocks, LockError};

const TASKS: u64 = 64;
const OPS: usize = 2000;
const KEYS: usize = 16;
const STALL: Duration = Duration::from_secs(60);

/// Tiny xorshift64 so each task gets its own reproducible op sequence.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // Never zero: xorshift would stay at zero.
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone, Copy, Debug)]
struct Config {
    permits: usize,
    max_waiters: Option<usize>,
}

#[derive(Default)]
struct KeyStats {
    /// Holders of the key right now, as seen by the holders themselves.
    in_use: AtomicUsize,
    acquired: AtomicUsize,
}

#[derive(Default)]
struct Totals {
    timeouts: AtomicUsize,
    busy: AtomicUsize,
    queue_full: AtomicUsize,
    cancelled: AtomicUsize,
}

/// Runs the critical section: at most `permits` holders at once per key.
async fn hold<K: Eq + Hash + Debug>(
    guard: KeyGuard<K>,
    expected: &K,
    stats: &KeyStats,
    permits: usize,
) {
    assert_eq!(guard.key(), expected);
    let before = stats.in_use.fetch_add(1, Ordering::SeqCst);
    assert!(
        before < permits,
        "{before} holders already on {expected:?} (permits {permits})"
    );
    stats.acquired.fetch_add(1, Ordering::Relaxed);
    // Let other tasks run (and contend) while the key is held.
    tokio::task::yield_now().await;
    stats.in_use.fetch_sub(1, Ordering::SeqCst);
    drop(guard);
}

/// Accepts the errors a configuration allows; anything else fails the test.
fn expect_rejection(error: LockError, allowed_queue_full: bool, totals: &Totals) {
    match error {
        LockError::QueueFull if allowed_queue_full => {
            totals.queue_full.fetch_add(1, Ordering::Relaxed)
        }
        other => panic!("unexpected {other:?}"),
    };
}

async fn stress<K>(config: Config, make_key: fn(usize) -> K)
where
    K: Eq + Hash + Clone + Debug + Send + Sync + 'static,
{
    let mut builder = KeyedLocks::builder().permits(config.permits);
    if let Some(n) = config.max_waiters {
        builder = builder.max_waiters(n);
    }
    let locks: KeyedLocks<K> = builder.build();
    let keys: Arc<Vec<K>> = Arc::new((0..KEYS).map(make_key).collect());
    let stats: Arc<Vec<KeyStats>> = Arc::new((0..KEYS).map(|_| KeyStats::default()).collect());
    let totals = Arc::new(Totals::default());
    let bounded = config.max_waiters.is_some();
    let permits = config.permits;

    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (locks, keys, stats, totals) =
                (locks.clone(), keys.clone(), stats.clone(), totals.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(task + 1);
                for _ in 0..OPS {
                    let i = rng.below(KEYS);
                    let (key, stats) = (&keys[i], &stats[i]);
                    match rng.below(5) {
                        0 => match locks.lock(key.clone()).await {
                            Ok(guard) => hold(guard, key, stats, permits).await,
                            Err(e) => expect_rejection(e, bounded, &totals),
                        },
                        1 => {
                            let wait = Duration::from_micros(rng.below(200) as u64);
                            match locks.lock_timeout(key.clone(), wait).await {
                                Ok(guard) => hold(guard, key, stats, permits).await,
                                Err(LockError::Timeout) => {
                                    totals.timeouts.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(e) => expect_rejection(e, bounded, &totals),
                            }
                        }
                        2 => match locks.try_lock(key.clone()) {
                            Ok(guard) => hold(guard, key, stats, permits).await,
                            Err(LockError::Busy) => {
                                totals.busy.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("try_lock: unexpected {e:?}"),
                        },
                        // Cancelled while queued, or once granted but before it ran: the
                        // yield wins on the second poll, whatever the lock did meanwhile.
                        3 => {
                            tokio::select! {
                                biased;
                                _ = tokio::task::yield_now() => {
                                    totals.cancelled.fetch_add(1, Ordering::Relaxed);
                                }
                                result = locks.lock(key.clone()) => match result {
                                    Ok(guard) => hold(guard, key, stats, permits).await,
                                    Err(e) => expect_rejection(e, bounded, &totals),
                                },
                            }
                        }
                        // Lock polled first, dropped when a short sleep wins.
                        _ => {
                            let nap = Duration::from_micros(rng.below(100) as u64 + 1);
                            tokio::select! {
                                biased;
                                result = locks.lock(key.clone()) => match result {
                                    Ok(guard) => hold(guard, key, stats, permits).await,
                                    Err(e) => expect_rejection(e, bounded, &totals),
                                },
                                _ = tokio::time::sleep(nap) => {
                                    totals.cancelled.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                }
            })
        })
        .collect();
    // A leaked permit shows up as tasks waiting forever: fail instead of hanging.
    let all = async {
        for task in tasks {
            task.await.expect("a stress task panicked");
        }
    };
    tokio::time::timeout(STALL, all)
        .await
        .expect("stress tasks stalled: a permit was probably leaked");
    let elapsed = started.elapsed();

    assert_eq!(locks.len(), 0, "entries left behind");
    assert!(locks.is_empty());
    // Every key offers all its permits at once, and not one more.
    let mut guards = Vec::new();
    for key in keys.iter() {
        for _ in 0..permits {
            guards.push(locks.try_lock(key.clone()).expect("a permit leaked"));
        }
        assert!(matches!(locks.try_lock(key.clone()), Err(LockError::Busy)));
    }
    assert_eq!(locks.len(), KEYS);
    drop(guards);
    assert_eq!(locks.len(), 0);

    for (key, stats) in keys.iter().zip(stats.iter()) {
        assert_eq!(stats.in_use.load(Ordering::SeqCst), 0);
        let acquired = stats.acquired.load(Ordering::Relaxed);
        assert!(acquired > 0, "key {key:?} was never acquired");
    }
    let acquired: usize = stats
        .iter()
        .map(|s| s.acquired.load(Ordering::Relaxed))
        .sum();
    eprintln!(
        "{config:?} {}: {} ops in {elapsed:?}; acquired {acquired}, timeouts {}, busy {}, \
         queue full {}, cancelled {}",
        std::any::type_name::<K>(),
        TASKS as usize * OPS,
        totals.timeouts.load(Ordering::Relaxed),
        totals.busy.load(Ordering::Relaxed),
        totals.queue_full.load(Ordering::Relaxed),
        totals.cancelled.load(Ordering::Relaxed),
    );
    // Contention really happened: some attempts found their key taken.
    assert!(totals.busy.load(Ordering::Relaxed) > 0);
}

fn u64_key(i: usize) -> u64 {
    i as u64 * 7919
}

fn string_key(i: usize) -> String {
    format!("order-{i}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stress_one_permit_u64() {
    let config = Config {
        permits: 1,
        max_waiters: None,
    };
    stress(config, u64_key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stress_three_permits_bounded_queue_u64() {
    let config = Config {
        permits: 3,
        max_waiters: Some(4),
    };
    stress(config, u64_key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stress_one_permit_string() {
    let config = Config {
        permits: 1,
        max_waiters: None,
    };
    stress(config, string_key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_three_permits_bounded_queue_string() {
    let config = Config {
        permits: 3,
        max_waiters: Some(4),
    };
    stress(config, string_key).await;
}
