//! One hot key hammered by many tasks for a fixed time, two ways in interleaved rounds:
//! hand-offs per second, and how evenly the tasks were served.

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
pub struct HotKey {
    /// Grants per second of the first way and of the second.
    pub rates: [f64; 2],
    /// Jain's fairness index over the tasks' grants of each way.
    pub fairness: [f64; 2],
    /// The median of the per-round ratios, first ÷ second.
    pub ratio: f64,
}

/// Runs `ways[0]` and `ways[1]` on `tasks` tasks for `run` each, `rounds` times, the
/// order turning from round to round.
pub async fn interleaved(ways: [&Op; 2], tasks: usize, rounds: usize, run: Duration) -> HotKey {
    let (mut ratios, mut rates, mut fairness) = (Vec::new(), [vec![], vec![]], [vec![], vec![]]);
    for round in 0..rounds {
        let mut rate = [0.0; 2];
        for turn in 0..2 {
            let which = (round + turn) % 2;
            let counts = hammer(ways[which].clone(), tasks, run).await;
            rate[which] = counts.iter().sum::<u64>() as f64 / run.as_secs_f64();
            rates[which].push(rate[which]);
            fairness[which].push(jain(&counts));
        }
        ratios.push(rate[0] / rate[1]);
    }
    HotKey {
        rates: rates.map(median),
        fairness: fairness.map(median),
        ratio: median(ratios),
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
