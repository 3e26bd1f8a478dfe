//! The timing of a lock held on a database session: how long a session known alive
//! counts as held, when its next liveness check is due, the server-side idle limit that
//! frees the lock of a holder cut off, and from when a grant counts.
//!
//! The three are one rule seen from three sides. A session heard from at `alive_at`
//! (a round trip sent then answered within the command timeout, so the server's idle
//! limit runs from after that instant) counts as held until one liveness interval plus
//! one command timeout later: its next check is due one interval after `alive_at` and
//! must answer within a command timeout. The server ends a session idle for one
//! interval plus *two* command timeouts: a live holder is never idle that long, and a
//! holder cut off declares its lease lost a command timeout before the server frees
//! the lock.

use std::time::Duration;

use tokio::time::Instant;

/// The default liveness interval of a session engine.
pub(crate) const DEFAULT_LIVENESS_INTERVAL: Duration = Duration::from_secs(1);
/// The default command timeout of a session engine.
pub(crate) const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// The timing every lock of one session backend follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timing {
    /// How often a held session is checked with a round trip.
    pub(crate) liveness_interval: Duration,
    /// The longest wait for one answer: connecting, a statement, a check, the unlock.
    pub(crate) command_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            liveness_interval: DEFAULT_LIVENESS_INTERVAL,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
        }
    }
}

impl Timing {
    /// Until when a session known alive at `alive_at` (its idle limit reset by a round
    /// trip sent then, or by a statement that ran until then) counts as held: the next
    /// check's timeout, one command timeout before the server's idle limit can end the
    /// session.
    pub(crate) fn valid_until(&self, alive_at: Instant) -> Instant {
        alive_at + self.liveness_interval + self.command_timeout
    }

    /// When the check of a lease valid until `deadline` is due: one command timeout
    /// before it, so an answer that takes a whole command timeout still comes in time.
    pub(crate) fn check_due(&self, deadline: Instant) -> Instant {
        deadline
            .checked_sub(self.command_timeout)
            .unwrap_or(deadline)
    }

    /// How long the server lets a session sit idle before it ends it and frees its
    /// locks: one liveness interval plus two command timeouts (see the module docs).
    pub(crate) fn server_idle_limit(&self) -> Duration {
        self.liveness_interval + 2 * self.command_timeout
    }

    /// A round trip sent at `sent` and answered now.
    pub(crate) fn answered(&self, sent: Instant) -> Answered {
        Answered {
            sent,
            prompt: sent.elapsed() <= self.command_timeout,
        }
    }
}

/// A round trip that granted a lock: when it was sent, and whether its answer came
/// within the command timeout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Answered {
    pub(crate) sent: Instant,
    pub(crate) prompt: bool,
}

impl Answered {
    /// From when the grant counts without a round trip of its own: its sending, if it
    /// answered within the command timeout on a session already seen to keep its locks
    /// past a statement (`checked`). `None`: the server's idle limit runs from the
    /// grant, which a late answer does not date, and a session never checked may be
    /// reset between statements; a confirming round trip must then answer within the
    /// command timeout, and the grant counts from its sending, or the grant is given
    /// back (the session closed).
    pub(crate) fn counts_from(&self, checked: bool) -> Option<Instant> {
        (self.prompt && checked).then_some(self.sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lease_ends_a_command_timeout_before_the_server_frees_the_lock() {
        let timing = Timing {
            liveness_interval: Duration::from_millis(100),
            command_timeout: Duration::from_millis(500),
        };
        let alive_at = Instant::now();
        let deadline = timing.valid_until(alive_at);
        assert_eq!(deadline - alive_at, Duration::from_millis(600));
        assert_eq!(
            timing.check_due(deadline),
            alive_at + timing.liveness_interval
        );
        assert_eq!(
            alive_at + timing.server_idle_limit() - deadline,
            timing.command_timeout
        );
    }

    #[test]
    fn a_late_or_unchecked_grant_needs_a_confirmation() {
        let sent = Instant::now();
        let prompt = Answered { sent, prompt: true };
        let late = Answered {
            sent,
            prompt: false,
        };
        assert_eq!(prompt.counts_from(true), Some(sent));
        assert_eq!(prompt.counts_from(false), None);
        assert_eq!(late.counts_from(true), None);
    }
}
