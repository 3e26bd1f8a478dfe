//! A granted lease: its validity deadline, the renewal task that moves it, and the
//! release that stops renewal before giving the record back.

use std::sync::Arc;

use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::give_back::give_back;
use super::renewal::keep;
use super::schedule::Entry;
use super::TtlBackend;
use crate::backend::{BoxFuture, Lease, LeaseSignal, ReleaseLease};

/// The lease for a grant of `target` to `token`, sent at `sent_at`, with its renewal:
/// a task of its own, or a place in the backend's [`Schedule`] until its first renewal.
pub(crate) fn grant<B: TtlBackend>(
    backend: &Arc<B>,
    target: B::Target,
    token: String,
    fence: Option<u64>,
    sent_at: Instant,
) -> Lease {
    let timing = backend.timing();
    let valid_until = timing.valid_until(sent_at, timing.first_ttl());
    let (lost, signal) = LeaseSignal::with_deadline(valid_until);
    let renewing = match backend.schedule() {
        Some(schedule) => {
            // Due for its first renewal, or its deadline if that comes first.
            let due = (sent_at + timing.lease / 3).min(valid_until);
            let entry = schedule.add(backend, target.clone(), token.clone(), sent_at, lost, due);
            Renewing::Scheduled(entry)
        }
        None => {
            let task = keep(
                backend.clone(),
                target.clone(),
                token.clone(),
                sent_at,
                lost,
            );
            Renewing::Task(tokio::spawn(task).abort_handle())
        }
    };
    let release = TtlRelease {
        backend: backend.clone(),
        target,
        token,
        renewing,
    };
    Lease::new(fence, signal, release)
}

/// Where a lease's renewal is.
enum Renewing {
    /// A task of its own.
    Task(AbortHandle),
    /// In the backend's schedule (then, maybe, a task the schedule started).
    Scheduled(Entry),
}

/// Gives a lease back: stops its renewal, then clears the record if still ours.
struct TtlRelease<B: TtlBackend> {
    backend: Arc<B>,
    target: B::Target,
    token: String,
    renewing: Renewing,
}

impl<B: TtlBackend> TtlRelease<B> {
    /// Stops the renewal; again: nothing.
    fn stop(&self) {
        match &self.renewing {
            Renewing::Task(task) => task.abort(),
            Renewing::Scheduled(entry) => {
                if let Some(schedule) = self.backend.schedule() {
                    schedule.cancel(*entry);
                }
            }
        }
    }
}

impl<B: TtlBackend> ReleaseLease for TtlRelease<B> {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        self.stop();
        // No renewal follows, so the record expires within one lease by itself.
        let now = Instant::now();
        let until = now + self.backend.timing().lease;
        Box::pin(async move {
            let (target, token) = (self.target.clone(), self.token.clone());
            // The grant was answered: no write of this token is still on its way.
            give_back(&self.backend, target, token, until, None).await;
        })
    }

    fn stop_renewal(&self) {
        self.stop();
    }
}

impl<B: TtlBackend> Drop for TtlRelease<B> {
    fn drop(&mut self) {
        // Also when dropped without `release` (no runtime left): renewal stops.
        self.stop();
    }
}
