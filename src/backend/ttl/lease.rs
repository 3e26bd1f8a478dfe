//! A granted lease: its validity deadline, the renewal task that moves it, and the
//! release that stops renewal before giving the record back.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::AbortHandle;
use tokio::time::{sleep_until, Instant};

use super::give_back::give_back;
use super::schedule::Entry;
use super::{Renewal, TtlBackend};
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LostReason, ReleaseLease};

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

/// Keeps a lease acquired at `acquired_at` alive, and raises `lost` at its local
/// deadline, at the first answer saying it is not ours, or as soon as the backend shows
/// the hold gone. Aborted when the lease is released or dropped.
pub(super) async fn keep<B: TtlBackend>(
    backend: Arc<B>,
    target: B::Target,
    token: String,
    acquired_at: Instant,
    lost: LeaseLostSender,
) {
    let timing = backend.timing();
    let period = timing.lease / 3;
    let hold_end = timing.max_hold.map(|max| acquired_at + max);
    // Invariant: the lease is valid (ours at the engine, modulo drift) until
    // `valid_until`; the signal holds the same deadline.
    let mut valid_until = timing.valid_until(acquired_at, timing.first_ttl());
    let mut next = acquired_at + period;
    let gone = backend.gone(&target);
    tokio::pin!(gone);
    loop {
        let renew = timing.renewal && hold_end.is_none_or(|end| next < end);
        // The deadline first: once it has passed, the lease is lost even if it is also
        // time to renew.
        tokio::select! {
            biased;
            () = sleep_until(valid_until) => break,
            () = &mut gone => {
                lost.lose(LostReason::NotOwner);
                return;
            }
            () = sleep_until(next), if renew => {}
        }
        let sent = Instant::now();
        let ttl = hold_end
            .map_or(timing.lease, |end| {
                timing.lease.min(end.saturating_duration_since(sent))
            })
            .max(Duration::from_millis(1));
        // An answer after the deadline comes too late to count.
        let limit = (sent + timing.command_timeout).min(valid_until);
        let renewal = tokio::select! {
            biased;
            () = &mut gone => Renewal::NotOurs,
            renewal = backend.renew(&target, &token, ttl, sent, limit) => renewal,
        };
        match renewal {
            Renewal::Renewed => {
                valid_until = timing.valid_until(sent, ttl);
                if !lost.extend(valid_until) {
                    return; // the old deadline passed while the answer was on its way
                }
                next = sent + period;
            }
            Renewal::NotOurs => {
                lost.lose(LostReason::NotOwner);
                return;
            }
            Renewal::Unknown => {
                lost.unanswered();
                next = Instant::now() + period / 4;
            }
        }
    }
    lost.lose_at_deadline();
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
            give_back(&self.backend, target, token, until, now).await;
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
