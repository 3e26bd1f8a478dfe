//! Metric names and the handles one layer, or one [`DistributedLocks`](crate::DistributedLocks),
//! records into.
//!
//! Everything goes through the [`metrics`] facade: install any recorder (Prometheus,
//! StatsD, …) and the series appear. Every series carries the label `name` (set with
//! [`KeyedLockLayer::name`](crate::KeyedLockLayer::name), or the name a
//! `DistributedLocks` is built with: a job lock records the same series as a layer);
//! keys never appear in labels. For `DistributedLocks`, "request" below reads
//! "acquisition", and a `try_lock` that finds the key held counts as a timeout.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | [`WAIT_SECONDS`] | histogram: arrival → guard, rejection or client gone | `outcome` = `acquired` \| `timeout` \| `queue_full` \| `cancelled` |
//! | [`HOLD_SECONDS`] | histogram: time the guard was held | |
//! | [`ACQUIRED_TOTAL`] | counter: `contended` when the acquisition needed more than one attempt (it queued in this process, or the engine found the key held elsewhere or tried again) | `contended` = `true` \| `false` |
//! | [`REJECTED_TOTAL`] | counter | `reason` = `timeout` \| `queue_full` \| `too_many_keys` \| `missing_key` \| `invalid_key` \| `backend` \| `lease_lost` \| `fingerprint_mismatch` \| `body_too_large` \| `body_unread` \| `misconfigured` \| `shutting_down` |
//! | [`WAITING`] | gauge: requests waiting now | |
//! | [`KEYS`] | gauge: keys with a holder or waiter now (layers sharing a `name` add up) | |
//! | [`LEASE_LOST_TOTAL`] | counter (distributed backends) | `reason` = `unreachable` \| `expired` \| `not_owner` \| `shut_down` ([`LostReason`]) |
//! | [`RENEWAL_FAILED_TOTAL`] | counter: lease renewals that went unanswered, lost lease or not ([`LeaseSignal::renewal_failures`](crate::LeaseSignal::renewal_failures)), added when the hold ends | |
//!
//! Handles are registered once per layer (or locks), on its first request, so a recorder
//! installed after the router was built but before it serves is still used.
//!
//! # OpenTelemetry names
//!
//! The names above are Prometheus style. [`use_naming`]`(`[`Naming::OpenTelemetry`]`)`,
//! called once at startup before any layer or lock records, switches the whole process
//! to OpenTelemetry's semantic-convention style instead — dotted names, the unit in the
//! metric's description (`Unit::Seconds`) rather than in its name, no `_total` — for an
//! OTLP exporter; labels (attributes) stay as they are:
//!
//! | Prometheus style (default) | OpenTelemetry style |
//! |---|---|
//! | `keyed_lock_wait_seconds` | `keyed_lock.wait.duration` (s) |
//! | `keyed_lock_hold_seconds` | `keyed_lock.hold.duration` (s) |
//! | `keyed_lock_acquired_total` | `keyed_lock.acquired` |
//! | `keyed_lock_rejected_total` | `keyed_lock.rejected` |
//! | `keyed_lock_waiting` | `keyed_lock.waiting` |
//! | `keyed_lock_keys` | `keyed_lock.keys` |
//! | `keyed_lock_lease_lost_total` | `keyed_lock.lease.lost` |
//! | `keyed_lock_renewal_failed_total` | `keyed_lock.renewal.failed` |
//! | `keyed_lock_replayed_total` | `keyed_lock.replayed` |
//! | `keyed_lock_stored_total` | `keyed_lock.stored` |
//!
//! ```
//! use tower_keyed_lock::metrics::{use_naming, Naming};
//!
//! // First thing in main, before the router serves.
//! use_naming(Naming::OpenTelemetry).expect("no series registered yet");
//! ```

use std::sync::OnceLock;

use metrics::{Counter, Gauge, Histogram, Unit};

use crate::backend::LostReason;
use crate::rejection_kind::RejectionKind;

/// Histogram buckets, in seconds, for [`WAIT_SECONDS`] and [`HOLD_SECONDS`]: 0.5 ms to
/// 10 s. Exporters that need buckets to export a histogram (not a summary) take these;
/// the Grafana dashboard in the repository's `dashboards/` queries `_bucket` series.
///
/// ```
/// use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let prometheus = PrometheusBuilder::new()
///     .set_buckets_for_metric(
///         Matcher::Prefix("keyed_lock_".into()),
///         tower_keyed_lock::metrics::HISTOGRAM_BUCKETS,
///     )?
///     .install_recorder()?;
/// // Serve `prometheus.render()` on your /metrics route.
/// # let _ = prometheus.render();
/// # Ok(())
/// # }
/// ```
pub const HISTOGRAM_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How metric series are named, for the whole process: see [`use_naming`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Naming {
    /// `keyed_lock_wait_seconds`, `keyed_lock_acquired_total`, … (the default).
    #[default]
    Prometheus,
    /// `keyed_lock.wait.duration`, `keyed_lock.acquired`, …: OpenTelemetry's
    /// semantic-convention style.
    OpenTelemetry,
}

/// The naming was already fixed: a series had been registered, or `use_naming` was
/// called before with another choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamingAlreadyFixed(pub Naming);

impl std::fmt::Display for NamingAlreadyFixed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "metric names are already {:?} style: choose the naming before any layer or lock records",
            self.0
        )
    }
}

impl std::error::Error for NamingAlreadyFixed {}

static NAMING: OnceLock<Naming> = OnceLock::new();

/// Chooses how every series of this process is named. Call it once, before any layer or
/// lock records (the first series registered fixes the naming, so a recorder never holds
/// both styles); a later call with another choice fails.
pub fn use_naming(naming: Naming) -> Result<(), NamingAlreadyFixed> {
    match *NAMING.get_or_init(|| naming) {
        fixed if fixed == naming => Ok(()),
        fixed => Err(NamingAlreadyFixed(fixed)),
    }
}

/// The naming in use: fixed by [`use_naming`], or Prometheus style at the first series
/// registered.
pub(crate) fn naming() -> Naming {
    *NAMING.get_or_init(Naming::default)
}

/// The metric names in use (see [`naming`]).
pub(crate) fn names() -> &'static Names {
    match naming() {
        Naming::Prometheus => &PROMETHEUS,
        Naming::OpenTelemetry => &OPENTELEMETRY,
    }
}

/// The name of every series, in one style.
pub(crate) struct Names {
    pub(crate) wait: &'static str,
    pub(crate) hold: &'static str,
    pub(crate) acquired: &'static str,
    pub(crate) rejected: &'static str,
    pub(crate) waiting: &'static str,
    pub(crate) keys: &'static str,
    pub(crate) lease_lost: &'static str,
    pub(crate) renewal_failed: &'static str,
}

const PROMETHEUS: Names = Names {
    wait: WAIT_SECONDS,
    hold: HOLD_SECONDS,
    acquired: ACQUIRED_TOTAL,
    rejected: REJECTED_TOTAL,
    waiting: WAITING,
    keys: KEYS,
    lease_lost: LEASE_LOST_TOTAL,
    renewal_failed: RENEWAL_FAILED_TOTAL,
};

const OPENTELEMETRY: Names = Names {
    wait: "keyed_lock.wait.duration",
    hold: "keyed_lock.hold.duration",
    acquired: "keyed_lock.acquired",
    rejected: "keyed_lock.rejected",
    waiting: "keyed_lock.waiting",
    keys: "keyed_lock.keys",
    lease_lost: "keyed_lock.lease.lost",
    renewal_failed: "keyed_lock.renewal.failed",
};

/// Histogram of the time from a request's arrival to its guard (or its rejection).
pub const WAIT_SECONDS: &str = "keyed_lock_wait_seconds";
/// Histogram of the time a guard was held.
pub const HOLD_SECONDS: &str = "keyed_lock_hold_seconds";
/// Counter of acquired guards, `contended` when an acquisition needed more than one
/// attempt (see [`DistributedGuard::contended`](crate::DistributedGuard::contended)).
pub const ACQUIRED_TOTAL: &str = "keyed_lock_acquired_total";
/// Counter of rejected requests.
pub const REJECTED_TOTAL: &str = "keyed_lock_rejected_total";
/// Gauge of requests waiting for a key now.
pub const WAITING: &str = "keyed_lock_waiting";
/// Gauge of keys that have a holder or a waiter now.
pub const KEYS: &str = "keyed_lock_keys";
/// Counter of leases lost while held (distributed backends).
pub const LEASE_LOST_TOTAL: &str = "keyed_lock_lease_lost_total";
/// Counter of lease renewals that went unanswered (distributed backends), added when
/// the hold ends.
pub const RENEWAL_FAILED_TOTAL: &str = "keyed_lock_renewal_failed_total";
/// Counter of responses replayed from the store (the replay layer).
pub const REPLAYED_TOTAL: &str = "keyed_lock_replayed_total";
/// Counter of responses written to the store (the replay layer).
pub const STORED_TOTAL: &str = "keyed_lock_stored_total";

/// The [`REJECTED_TOTAL`] counters of one `name`, one per [`RejectionKind`]: the lock
/// layer and the replay layer under it count into the same series.
pub(crate) struct Rejected([Counter; RejectionKind::ALL.len()]);

impl Rejected {
    pub(crate) fn new(name: &metrics::SharedString) -> Self {
        let rejected = names().rejected;
        Self(RejectionKind::ALL.map(
            |kind| metrics::counter!(rejected, "name" => name.clone(), "reason" => kind.as_str()),
        ))
    }

    pub(crate) fn increment(&self, kind: RejectionKind) {
        self.0[kind as usize].increment(1);
    }
}

/// The handles of one layer.
pub(crate) struct Metrics {
    pub(crate) wait_acquired: Histogram,
    pub(crate) wait_timeout: Histogram,
    pub(crate) wait_queue_full: Histogram,
    /// Waits whose request was dropped (client disconnect, an outer timeout).
    pub(crate) wait_cancelled: Histogram,
    pub(crate) hold: Histogram,
    pub(crate) acquired_uncontended: Counter,
    pub(crate) acquired_contended: Counter,
    rejected: Rejected,
    pub(crate) waiting: Gauge,
    pub(crate) keys: Gauge,
    /// One per [`LostReason`], at its index.
    lease_lost: [Counter; 4],
    renewal_failed: Counter,
}

impl Metrics {
    pub(crate) fn new(name: &str) -> Self {
        let n = names();
        describe(n);
        let name = metrics::SharedString::from(name.to_owned());
        let rejected = Rejected::new(&name);
        Self {
            wait_acquired: metrics::histogram!(n.wait, "name" => name.clone(), "outcome" => "acquired"),
            wait_timeout: metrics::histogram!(n.wait, "name" => name.clone(), "outcome" => "timeout"),
            wait_queue_full: metrics::histogram!(n.wait, "name" => name.clone(), "outcome" => "queue_full"),
            wait_cancelled: metrics::histogram!(n.wait, "name" => name.clone(), "outcome" => "cancelled"),
            hold: metrics::histogram!(n.hold, "name" => name.clone()),
            acquired_uncontended: metrics::counter!(n.acquired, "name" => name.clone(), "contended" => "false"),
            acquired_contended: metrics::counter!(n.acquired, "name" => name.clone(), "contended" => "true"),
            rejected,
            waiting: metrics::gauge!(n.waiting, "name" => name.clone()),
            keys: metrics::gauge!(n.keys, "name" => name.clone()),
            lease_lost: LostReason::ALL.map(|reason| {
                metrics::counter!(n.lease_lost, "name" => name.clone(), "reason" => reason.as_str())
            }),
            renewal_failed: metrics::counter!(n.renewal_failed, "name" => name.clone()),
        }
    }

    pub(crate) fn rejected(&self, kind: RejectionKind) {
        self.rejected.increment(kind);
    }

    /// What a distributed hold that ends records besides its time: the lease lost, if
    /// it was, and its renewals that went unanswered.
    pub(crate) fn lease_ended(&self, lost: Option<LostReason>, renewal_failures: u32) {
        if let Some(reason) = lost {
            self.lease_lost[reason.index()].increment(1);
        }
        if renewal_failures > 0 {
            self.renewal_failed.increment(u64::from(renewal_failures));
        }
    }
}

fn describe(n: &Names) {
    metrics::describe_histogram!(
        n.wait,
        Unit::Seconds,
        "Time from a request's arrival to its key guard, its rejection or its cancellation."
    );
    metrics::describe_histogram!(n.hold, Unit::Seconds, "Time a key guard was held.");
    metrics::describe_counter!(
        n.acquired,
        "Key guards acquired, by whether the request had to wait."
    );
    metrics::describe_counter!(
        n.rejected,
        "Requests answered by the lock layer instead of the service, by reason."
    );
    metrics::describe_gauge!(n.waiting, "Requests waiting for a key now.");
    metrics::describe_gauge!(n.keys, "Keys with a holder or a waiter now.");
    metrics::describe_counter!(n.lease_lost, "Distributed leases lost while held.");
    metrics::describe_counter!(
        n.renewal_failed,
        "Distributed lease renewals that went unanswered (the lease lost or not)."
    );
}

#[cfg(test)]
mod tests {
    use crate::rejection_kind::RejectionKind;

    /// The table in the module docs names every reason the layer registers.
    #[test]
    fn the_docs_list_every_reason() {
        let docs = include_str!("metrics.rs");
        let row = docs
            .lines()
            .find(|line| line.starts_with("//! | [`REJECTED_TOTAL`]"))
            .expect("a REJECTED_TOTAL row");
        for kind in RejectionKind::ALL {
            assert!(row.contains(&format!("`{}`", kind.as_str())), "{row}");
        }
        assert_eq!(
            row.matches("\\|").count() + 1,
            RejectionKind::ALL.len(),
            "{row}"
        );
    }
}
