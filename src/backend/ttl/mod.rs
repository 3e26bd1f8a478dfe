//! The TTL-lease engine: the life cycle every backend whose lock is a record with an
//! expiry shares (Redis, DynamoDB), written once.
//!
//! A backend brings its own atomic steps — an attempt that grants with a fencing token,
//! a renewal that extends the record if its token still holds it, a give-back that
//! clears it if so — and its own wait between attempts (pub/sub, polling). The engine
//! does the rest, the same way for every backend:
//!
//! - `lease`: the granted [`Lease`](crate::backend::Lease): its validity deadline
//!   (send time + TTL − drift margin, on the monotonic clock, in the
//!   [`LeaseSignal`](crate::backend::LeaseSignal) itself) and the release that stops
//!   renewal before giving back;
//! - `renewal`: the renewal loop (every lease/3, stopping at the first definite "not
//!   the owner");
//! - `schedule`: one renewal schedule per backend, for the backends that keep one: a
//!   lease gets its renewal task only once due for a first renewal (most are released
//!   before), so a short hold costs no task;
//! - `give_back`: giving a token's hold back, retried in the background until the
//!   record would expire anyway, and the in-flight guard that gives back what an
//!   attempt whose answer never came may have been granted;
//! - `acquire`: the acquire loop of the engines that take a record by a conditional
//!   write (Redis, Redlock, DynamoDB, Azure Blob, S3) and wait by looking again or,
//!   where the engine tells of a change (Redis's release messages), until it does;
//! - `polled`: the engines whose lock is one record taken by a conditional write and
//!   polled by waiters (DynamoDB, S3, Azure Blob) bring their attempt, renewal and
//!   give-back; their token, in-flight guard, grant and pauses are written once;
//! - `watched`: the record versions a backend saw on other holders' records, for the
//!   engines that take a record over once it stopped changing for a lease (DynamoDB,
//!   S3);
//! - `token`: fresh random tokens.

// etcd uses the engine without the helpers of record-based engines (random tokens, the
// Redis prefix rule, re-arming an attempt's guard).
#![cfg_attr(
    not(any(feature = "redis", feature = "dynamodb", feature = "s3")),
    allow(dead_code, unused_imports)
)]

#[cfg(any(
    feature = "redis",
    feature = "dynamodb",
    feature = "azure-blob",
    feature = "s3"
))]
mod acquire;
mod give_back;
mod lease;
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "s3"))]
mod polled;
mod renewal;
mod schedule;
mod token;
#[cfg(any(feature = "dynamodb", feature = "s3"))]
mod watched;

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

#[cfg(any(
    feature = "redis",
    feature = "dynamodb",
    feature = "azure-blob",
    feature = "s3"
))]
pub(crate) use self::acquire::{acquire, Attempt, Contend, Round};
#[cfg(feature = "zookeeper")]
pub(crate) use self::give_back::give_back;
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "etcd"))]
pub(crate) use self::give_back::give_back_call;
pub(crate) use self::give_back::InFlight;
pub(crate) use self::lease::grant;
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "s3"))]
pub(crate) use self::polled::{Granted, PolledRecord};
pub(crate) use super::backoff::{jitter, Backoff};
// The engines that keep a schedule (Redis, Redlock) name it; the others only use it.
#[cfg_attr(not(feature = "redis"), allow(unused_imports))]
pub(crate) use self::schedule::{GoneForAll, Schedule};
pub(crate) use self::token::{fresh_token, sha256_hex};
#[cfg(any(feature = "dynamodb", feature = "s3"))]
pub(crate) use self::watched::{Version, Watched};

/// The timing every lease of one backend follows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// The TTL written with every grant and renewal.
    pub(crate) lease: Duration,
    /// Taken off every validity period for clock drift between this process and the
    /// engine.
    pub(crate) drift: Duration,
    /// The longest one command may take before its answer counts as lost.
    pub(crate) command_timeout: Duration,
    /// Whether held leases are renewed at all.
    pub(crate) renewal: bool,
    /// The longest a lease is kept, renewals included (`None`: as long as held).
    pub(crate) max_hold: Option<Duration>,
}

impl Timing {
    /// Leases of `lease`, renewed while held, with this drift margin and command
    /// timeout.
    pub(crate) fn new(lease: Duration, drift: Duration, command_timeout: Duration) -> Self {
        Timing {
            lease,
            drift,
            command_timeout,
            renewal: true,
            max_hold: None,
        }
    }

    /// Whether held leases are renewed at all.
    pub(crate) fn renewal(self, renewal: bool) -> Self {
        Timing { renewal, ..self }
    }

    /// The longest a lease is kept, renewals included.
    #[cfg(feature = "redis")]
    pub(crate) fn max_hold(self, max_hold: Option<Duration>) -> Self {
        Timing { max_hold, ..self }
    }

    /// The TTL an acquisition asks for: the lease, shortened to `max_hold`.
    pub(crate) fn first_ttl(&self) -> Duration {
        self.max_hold.map_or(self.lease, |max| max.min(self.lease))
    }

    /// Until when a hold written at `sent` with `ttl` is ours, modulo drift.
    pub(crate) fn valid_until(&self, sent: Instant, ttl: Duration) -> Instant {
        sent + ttl.saturating_sub(self.drift)
    }
}

/// The drift margin when none is set: 1% of the lease + 2 ms.
pub(crate) fn default_drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

/// When a wait that starts now ends (a wait too long for the clock: in a year).
pub(crate) fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365))
}

/// What one renewal found.
pub(crate) enum Renewal {
    /// Extended: the token holds the record for the TTL asked.
    Renewed,
    /// Definitely not ours any more: deleted, expired or taken over.
    NotOurs,
    /// No answer, or an answer that proves nothing: try again; the deadline stands.
    Unknown,
}

/// What one give-back attempt found.
pub(crate) enum GiveBack {
    /// The token held the record, and no longer does.
    Cleared,
    /// The token does not hold the record (it never got it, or lost it).
    NotOurs,
    /// No answer, or a failure: the token may still hold the record.
    NoAnswer,
}

/// A backend's atomic steps on its records; the engine runs the life cycle around
/// them.
pub(crate) trait TtlBackend: Send + Sync + 'static {
    /// What names one lock at the engine (its keys, its item).
    type Target: Clone + Send + Sync + 'static;

    /// The timing of this backend's leases.
    fn timing(&self) -> Timing;

    /// Extends `token`'s hold on `target` to `ttl`. Sent at `sent`; must answer by
    /// `limit` (then [`Renewal::Unknown`]).
    fn renew(
        &self,
        target: &Self::Target,
        token: &str,
        ttl: Duration,
        sent: Instant,
        limit: Instant,
    ) -> impl Future<Output = Renewal> + Send;

    /// Resolves when the engine shows, before any renewal would, that the hold on
    /// `target` is gone (etcd: a watch saw the holder's key deleted); the lease is then
    /// lost at once. Never, by default.
    fn gone(&self, target: &Self::Target) -> impl Future<Output = ()> + Send {
        let _ = target;
        std::future::pending()
    }

    /// Clears `target` if `token` holds it; one try, bounded by the command timeout.
    fn try_give_back(
        &self,
        target: &Self::Target,
        token: &str,
    ) -> impl Future<Output = GiveBack> + Send;

    /// The engine's name in logs ("redis", "dynamodb").
    fn engine(&self) -> &'static str;

    /// The backend's renewal schedule, if it keeps one: its leases then get a renewal
    /// task only once due for a first renewal. Only for a backend whose
    /// [`gone`](Self::gone) is the same for every target (the schedule watches it for
    /// all its leases at once). `None` by default: a task per lease from its grant.
    fn schedule(&self) -> Option<&Schedule<Self>>
    where
        Self: Sized,
    {
        None
    }

    /// Until when the give-back of an attempt sent at `sent_at`, whose answer never
    /// came, keeps trying: by default until the grant it may have made expires.
    fn give_back_until(&self, sent_at: Instant) -> Instant {
        sent_at + self.timing().first_ttl()
    }

    /// From when a give-back of such an attempt that finds the record not ours can
    /// stop: no write of the attempt can land after that. The engine first answered
    /// the give-back at `answered_at`. By default two command timeouts after the
    /// attempt was sent (it was abandoned after one, and an engine that read it by
    /// then has applied it by another), and one after that first answer: an engine
    /// that was paused with the attempt queued runs it once resumed, beside the
    /// give-back, not always before it.
    fn settles_at(&self, sent_at: Instant, answered_at: Instant) -> Instant {
        let command_timeout = self.timing().command_timeout;
        (sent_at + 2 * command_timeout).max(answered_at + command_timeout)
    }
}
