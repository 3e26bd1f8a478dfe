//! [`Lateness`]: how late this process wakes its timers, the margin a timing assertion
//! allows for the machine's load, measured by the check itself instead of guessed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How late this process wakes its timers: a task that sleeps a few milliseconds again
/// and again and keeps the worst delay past each sleep's end; it stops when dropped. On
/// a quiet machine the delay is a millisecond or two; beside a build on two cores,
/// hundreds. A timing bound a check asserts is widened by it
/// ([`allowing`](Self::allowing)), so the check holds under load.
pub struct Lateness {
    worst_micros: Arc<AtomicU64>,
    ticker: JoinHandle<()>,
}

impl Lateness {
    const TICK: Duration = Duration::from_millis(5);

    /// Starts watching, on the current tokio runtime.
    pub fn watch() -> Self {
        let worst_micros = Arc::new(AtomicU64::new(0));
        let worst = worst_micros.clone();
        let ticker = tokio::spawn(async move {
            loop {
                let due = Instant::now() + Self::TICK;
                tokio::time::sleep_until(due).await;
                let late = Instant::now().saturating_duration_since(due);
                worst.fetch_max(late.as_micros() as u64, Ordering::Relaxed);
            }
        });
        Lateness {
            worst_micros,
            ticker,
        }
    }

    /// The worst delay seen so far.
    pub fn worst(&self) -> Duration {
        Duration::from_micros(self.worst_micros.load(Ordering::Relaxed))
    }

    /// `bound` plus what the load cost: twice the worst delay seen (a deadline's timer
    /// and the answer's task can each be that late).
    pub fn allowing(&self, bound: Duration) -> Duration {
        self.allowing_hops(bound, 2)
    }

    /// `bound` plus the worst delay seen for each of `hops` wake-ups on the measured
    /// path that the load can each put off (a task's first poll, a timer, a join).
    pub fn allowing_hops(&self, bound: Duration, hops: u32) -> Duration {
        bound + hops * self.worst()
    }
}

impl Drop for Lateness {
    fn drop(&mut self) {
        self.ticker.abort();
    }
}
