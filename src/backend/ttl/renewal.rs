//! The renewal loop of one lease, for every TTL engine: renew at lease/3, move the
//! deadline on each answer, and raise the lost signal at the deadline or at the first
//! sign that the hold is gone. Started by the grant (`lease.rs`) or by the backend's
//! schedule (`schedule.rs`) when the first renewal is due.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep_until, Instant};

use super::{Renewal, TtlBackend};
use crate::backend::{LeaseLostSender, LostReason};

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
        // Should the deadline come first, the engine did not answer in time.
        lost.asking();
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
                tracing::warn!(
                    engine = backend.engine(),
                    "a lease renewal went unanswered; the lease holds until its deadline, \
                     and the renewal is tried again"
                );
                lost.unanswered();
                next = Instant::now() + period / 4;
            }
        }
    }
    lost.lose_at_deadline();
}
