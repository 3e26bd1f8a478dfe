//! Graceful shutdown: no new key, a drain of the holders up to a deadline, then every
//! remote lease still held cut off (its holder told, the lease given back), so the next
//! instance takes the keys at once instead of after the lease's expiry. A leadership
//! ([`LeaderElection`](super::LeaderElection)) is cut off as the shutdown begins.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::backend::CutOff;

/// How often the drain looks whether the holders have finished. A shutdown is rare
/// and the deadline bounds it; a notification per release would cost every request.
const DRAIN_POLL: Duration = Duration::from_millis(5);

/// What [`DistributedLocks::shutdown`](super::DistributedLocks::shutdown) did, counted
/// in keys held in this process when it began (with one permit per key, one key is one
/// holder).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Keys whose holders finished before the deadline.
    pub finished: usize,
    /// Keys still held at the deadline: their holders were cut off (told through their
    /// lost signal, their remote leases given back) and may still be running.
    pub cut_off: usize,
    /// Remote leases given back at the deadline (0 in process).
    pub leases_released: usize,
}

impl fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} finished, {} cut off ({} remote leases released)",
            self.finished, self.cut_off, self.leases_released
        )
    }
}

/// The shutdown state of one set of locks: whether it began, and the remote leases held
/// now, so that it can cut them off.
#[derive(Default)]
pub(crate) struct Shutdown {
    started: AtomicBool,
    next_id: AtomicU64,
    leases: Mutex<HashMap<u64, Held>>,
}

/// A remote lease the shutdown may cut off.
struct Held {
    cut_off: CutOff,
    /// Cut off as the shutdown begins, not at its deadline: a leadership, which has no
    /// end of its own to wait for and should pass to another instance at once.
    at_start: bool,
}

impl Shutdown {
    /// Whether no key may be granted any more.
    pub(crate) fn is_started(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }

    /// Refuses every later grant.
    pub(crate) fn start(&self) {
        self.started.store(true, Ordering::Release);
    }

    /// Registers a remote lease held now; the guard unregisters it with the id.
    pub(crate) fn register(&self, cut_off: CutOff) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let held = Held {
            cut_off,
            at_start: false,
        };
        self.leases().insert(id, held);
        id
    }

    /// Lease `id` is cut off as the shutdown begins, not at its deadline; at once if it
    /// already began.
    pub(crate) fn cut_off_at_start(&self, id: u64) {
        if let Some(held) = self.leases().get_mut(&id) {
            held.at_start = true;
        }
        // Marked before this look: a shutdown that began since either found the mark
        // (and took the lease out of the map) or is seen here. Whoever takes the lease
        // out of the map cuts it off, once.
        if self.is_started() {
            if let Some(held) = self.leases().remove(&id) {
                tokio::spawn(held.cut_off.cut());
            }
        }
    }

    /// The guard of lease `id` gives it back itself.
    pub(crate) fn unregister(&self, id: u64) {
        self.leases().remove(&id);
    }

    /// Cuts off every remote lease still held; returns how many.
    pub(crate) async fn cut_off_all(&self) -> usize {
        let leases: Vec<CutOff> = self
            .leases()
            .drain()
            .map(|(_, held)| held.cut_off)
            .collect();
        Self::cut(leases).await
    }

    /// Cuts off the leases marked to be cut off as the shutdown begins; returns how many.
    async fn cut_off_marked(&self) -> usize {
        let leases: Vec<CutOff> = {
            let mut held = self.leases();
            let marked: Vec<u64> = (held.iter())
                .filter(|(_, held)| held.at_start)
                .map(|(id, _)| *id)
                .collect();
            (marked.iter())
                .filter_map(|id| held.remove(id))
                .map(|held| held.cut_off)
                .collect()
        };
        Self::cut(leases).await
    }

    /// Cuts `leases` off in parallel; returns how many.
    async fn cut(leases: Vec<CutOff>) -> usize {
        let count = leases.len();
        // One task per lease, so that a dropped shutdown future does not stop a release
        // half-way, and the leases are given back in parallel.
        let releases: Vec<_> = leases
            .into_iter()
            .map(|lease| tokio::spawn(lease.cut()))
            .collect();
        for release in releases {
            let _ = release.await;
        }
        count
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Held>> {
        // Entries are only inserted and removed whole: a poisoned map is consistent.
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Drains `held` (the keys held in this process) until none is left or `deadline`
/// passes, then cuts off what is left.
pub(crate) async fn drain(
    shutdown: &Shutdown,
    held: impl Fn() -> usize,
    deadline: Duration,
) -> ShutdownReport {
    shutdown.start();
    let at_start = held();
    // Leaderships step down now: another instance is elected while this one drains.
    let stepped_down = shutdown.cut_off_marked().await;
    let until = tokio::time::Instant::now() + deadline;
    while held() > 0 && tokio::time::Instant::now() < until {
        tokio::time::sleep(DRAIN_POLL.min(until - tokio::time::Instant::now())).await;
    }
    let left = held();
    let leases_released = stepped_down + shutdown.cut_off_all().await;
    ShutdownReport {
        finished: at_start.saturating_sub(left),
        cut_off: left.min(at_start),
        leases_released,
    }
}
