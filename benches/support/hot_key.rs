//! Many tasks hammering locks for a fixed time, several ways in interleaved rounds:
//! grants per second, and how evenly the tasks were served. On one hot key these are
//! hand-offs; with a key per task, uncontended locks.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tower_keyed_lock::DistributedLocks;

/// One acquire + release by task `task` (of `0..tasks`).
pub type Op = Arc<dyn Fn(usize) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// The crate's way: task `task` locks and releases `"hot"` on instance `task % 2`.
pub fn locking(instances: [DistributedLocks; 2]) -> Op {
    Arc::new(move |task| {
        let locks = instances[task % 2].clone();
        Box::pin(async move {
            let guard = locks.lock("hot").await.expect("granted in the end");
            guard.release().await;
        })
    })
}

/// What [`interleaved`] measured of each way: medians over the rounds.
pub struct HotKey<const N: usize> {
    /// Grants per second of each way.
    pub rates: [f64; N],
    /// Jain's fairness index over the tasks' grants of each way.
    pub fairness: [f64; N],
    /// The median of the per-round ratios of the first way's rate to each way's (1 for
    /// the first itself).
    pub ratios: [f64; N],
}

/// Runs each of `ways` on `tasks` tasks for `run`, `rounds` times, the order turning
/// from round to round.
pub async fn interleaved<const N: usize>(
    ways: [&Op; N],
    tasks: usize,
    rounds: usize,
    run: Duration,
) -> HotKey<N> {
    let mut rates: [Vec<f64>; N] = std::array::from_fn(|_| Vec::new());
    let (mut ratios, mut fairness) = (rates.clone(), rates.clone());
    for round in 0..rounds {
        let mut rate = [0.0; N];
        for turn in 0..N {
            let which = (round + turn) % N;
            let counts = hammer(ways[which].clone(), tasks, run).await;
            rate[which] = counts.iter().sum::<u64>() as f64 / run.as_secs_f64();
            rates[which].push(rate[which]);
            fairness[which].push(jain(&counts));
        }
        for (ratios, each) in ratios.iter_mut().zip(rate) {
            ratios.push(rate[0] / each);
        }
    }
    HotKey {
        rates: rates.map(median),
        fairness: fairness.map(median),
        ratios: ratios.map(median),
    }
}

/// Runs `op` on `tasks` tasks for `run`; the grants of each task.
async fn hammer(op: Op, tasks: usize, run: Duration) -> Vec<u64> {
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<Vec<AtomicU64>> = Arc::new((0..tasks).map(|_| AtomicU64::new(0)).collect());
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (op, stop, counts) = (op.clone(), stop.clone(), counts.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    op(task).await;
                    counts[task].fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    for handle in handles {
        handle.await.unwrap();
    }
    counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
}

/// Jain's fairness index of the grants per task: (Σx)² / (n·Σx²), 1 when every task
/// got as many.
pub fn jain(counts: &[u64]) -> f64 {
    let sum: f64 = counts.iter().map(|&c| c as f64).sum();
    let squares: f64 = counts.iter().map(|&c| (c as f64).powi(2)).sum();
    if squares == 0.0 {
        return 0.0;
    }
    sum * sum / (counts.len() as f64 * squares)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
