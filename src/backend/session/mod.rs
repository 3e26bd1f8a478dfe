//! The session-lock core: the life cycle of a lock held on a pooled database session
//! (PostgreSQL advisory locks, MySQL named locks), written once.
//!
//! Such a lock has no expiry and no token at the server: it lasts as long as the
//! session that holds it, and ends with it. An engine brings its own primitives
//! ([`SessionLock`]): its session type, the liveness check that asks the session
//! whether it is still the one that holds the lock, the checked unlock, and how to
//! close a session that may still hold it. The core does the rest, the same way for
//! both engines:
//!
//! - `timing`: the lease's deadline (one liveness interval plus one command timeout
//!   from the last round trip known to have reset the server's idle limit), when the
//!   next check is due, the server-side idle limit that frees a holder cut off a
//!   command timeout later, and the rule that a grant counts only from a round trip
//!   answered within the command timeout (else a confirming round trip must, or the
//!   grant is given back);
//! - `watch`: the task that watches a held session until release (the check's answer
//!   moves the deadline; a session that ended, went silent or answers for another
//!   raises the lease's lost signal at once), then stops the check and unlocks; a
//!   session that cannot be unlocked cleanly is closed, never returned to the pool;
//! - `holds`: the locks a backend holds; a young one gets its watching task only once
//!   its first check is due (most are released before), its session looked at
//!   meanwhile with the others;
//! - `hold`: the lease handed out, and its release: on the caller's task while the
//!   lock is young, else through its task;
//! - `retry`: only the wait bounds the waiting: an attempt that failed in passing is
//!   tried again on a fresh session until the wait ends (a server that never answered
//!   is told at once);
//! - `settings`: the settings both builders share (prefix, liveness interval, command
//!   timeout) and the checks of other settings both make;
//! - `builder`: what both builders do with their settings: a change drops what was made
//!   from the old ones, and the first setting refused is kept for `build` to return;
//! - `bounded`: a round trip or an acquisition within its limit, without the copy of
//!   the future an `async fn` wrapper keeps.

mod bounded;
mod builder;
mod hold;
mod holds;
mod retry;
mod settings;
mod timing;
mod watch;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

pub(crate) use self::bounded::bounded;
#[cfg(test)]
pub(crate) use self::builder::testing;
pub(crate) use self::builder::{Builder, Configurable, Draft};
pub(crate) use self::hold::hold;
pub(crate) use self::holds::Holds;
pub(crate) use self::retry::{within_the_wait, Reached};
pub(crate) use self::settings::{is_plain_or_qualified, refused_pool_size, Settings};
pub(crate) use self::timing::{
    Answered, Timing, DEFAULT_COMMAND_TIMEOUT, DEFAULT_LIVENESS_INTERVAL,
};
#[cfg(feature = "replay")]
use crate::backend::{BoxFuture, RecordWrite};
use crate::backend::{LeaseLostSender, LostReason};
use crate::LockError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whether a replay record written with a release was written (not refused by a newer
/// fencing token).
#[cfg(feature = "replay")]
pub(crate) type Written = BoxFuture<Result<bool, LockError>>;

/// What one liveness check of a held session found.
pub(crate) enum Checked {
    /// The session that holds the lock answered, still holding it: known alive at this
    /// instant (its idle limit at the server runs from after it).
    Alive(Instant),
    /// An answer that tells nothing (a statement interrupted): look again.
    Quiet,
    /// Another session answered, or the session no longer holds the lock.
    NotOwner,
    /// The session ended, its connection broke, or the check went unanswered within
    /// its limit.
    Failed(BoxError),
}

/// An engine's primitives on a lock held by a session; the core runs the hold around
/// them (see the module docs).
pub(crate) trait SessionLock: Send + Sync + 'static {
    /// A connection whose session holds the lock. Dropped, it is closed (the server
    /// then ends the session and frees its locks); only
    /// [`give_back`](Self::give_back) pools it again.
    type Session: Send + Sync + 'static;
    /// What names the held lock on its session (for the checks, the unlock and logs).
    type Held: fmt::Display + Send + Sync + 'static;
    /// How a release ends the hold; the default when the release was dropped unsent.
    type Release: Default + Send + 'static;

    /// The engine's name in logs ("PostgreSQL").
    const ENGINE: &'static str;
    /// Why a session answered for another one, in logs.
    const SHARED_SESSION: &'static str;
    /// Whether a checked release reports what the unlock found (else only a lease
    /// lost before it).
    const REPORTS_RELEASE: bool = true;

    /// The next liveness check of `session`, which holds `held` until `deadline`: due
    /// at [`Timing::check_due`], answered by `deadline` at the latest. Calls
    /// [`LeaseLostSender::asking`] on `lost` as it goes out to the server: a deadline
    /// that passes before the answer is then the engine's, not a stalled holder's.
    fn check(
        &self,
        session: &mut Self::Session,
        held: &Self::Held,
        deadline: Instant,
        lost: &LeaseLostSender,
    ) -> impl Future<Output = Checked> + Send;

    /// Ends a check still pending when the lease is released, with what it found. By
    /// default the check is abandoned: an engine whose round trips may be dropped
    /// half-way with the session still in step.
    fn end_check<F>(
        &self,
        pending: Pin<&mut F>,
        held: &Self::Held,
    ) -> impl Future<Output = Checked> + Send
    where
        F: Future<Output = Checked> + Send,
    {
        let _ = (pending, held);
        std::future::ready(Checked::Quiet)
    }

    /// Gives the lock up on `session` with a statement that says whether it was held:
    /// `Ok` only when the session is known to hold nothing now.
    fn unlock(
        &self,
        session: &mut Self::Session,
        held: &Self::Held,
        release: Self::Release,
    ) -> impl Future<Output = Result<(), LostReason>> + Send;

    /// Returns a session known to hold nothing to the pool.
    fn give_back(&self, session: Self::Session);

    /// The locks this backend holds.
    fn holds(&self) -> &Holds<Self>
    where
        Self: Sized;

    /// Whether `session` shows that it ended, seen without a round trip; for an engine
    /// whose [`Holds`] look at young sessions. Never, by default.
    fn is_closed(&self, session: &Self::Session) -> bool {
        let _ = session;
        false
    }

    /// Closes a session whose hold ended for `reason` and which may still hold the
    /// lock. By default it is dropped (closed).
    fn close(
        &self,
        session: Self::Session,
        held: &Self::Held,
        reason: LostReason,
    ) -> impl Future<Output = ()> + Send {
        let _ = (held, reason);
        drop(session);
        std::future::ready(())
    }

    /// Which backend's replay records a lease of `held` may write with its release
    /// (see [`release_writing`](Self::release_writing)); none by default.
    #[cfg(feature = "replay")]
    fn writes_records(&self, held: &Self::Held) -> Option<usize> {
        let _ = held;
        None
    }

    /// The release that writes `record` with the unlock, for a lease of backend
    /// `writer`, and the future of whether it was written; `None` for a record made for
    /// another backend.
    #[cfg(feature = "replay")]
    fn release_writing(record: RecordWrite, writer: usize) -> Option<(Self::Release, Written)> {
        let _ = (record, writer);
        None
    }
}

/// Runs `acquire` within the wait plus one command timeout, however many of its round
/// trips were slow; cut short, it drops its session (closed, so whatever the server
/// granted it is freed) and fails with `unanswered`.
pub(crate) fn within_wait<T>(
    timing: Timing,
    wait: Duration,
    acquire: impl Future<Output = Result<T, LockError>>,
    unanswered: impl FnOnce() -> LockError,
) -> impl Future<Output = Result<T, LockError>> {
    let limit = wait.saturating_add(timing.command_timeout);
    bounded(limit, acquire, |outcome| {
        outcome.unwrap_or_else(|_| Err(unanswered()))
    })
}
