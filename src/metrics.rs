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
//! | [`ACQUIRED_TOTAL`] | counter | `contended` = `true` \| `false` |
//! | [`REJECTED_TOTAL`] | counter | `reason` = `timeout` \| `queue_full` \| `too_many_keys` \| `missing_key` \| `invalid_key` \| `backend` \| `lease_lost` \| `fingerprint_mismatch` \| `body_too_large` \| `body_unread` \| `misconfigured` |
//! | [`WAITING`] | gauge: requests waiting now | |
//! | [`KEYS`] | gauge: keys with a holder or waiter now (layers sharing a `name` add up) | |
//! | [`LEASE_LOST_TOTAL`] | counter (distributed backends) | |
//!
//! Handles are registered once per layer (or locks), on its first request, so a recorder
//! installed after the router was built but before it serves is still used.

use metrics::{Counter, Gauge, Histogram, Unit};

use crate::reject::RejectionKind;

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

/// Histogram of the time from a request's arrival to its guard (or its rejection).
pub const WAIT_SECONDS: &str = "keyed_lock_wait_seconds";
/// Histogram of the time a guard was held.
pub const HOLD_SECONDS: &str = "keyed_lock_hold_seconds";
/// Counter of acquired guards.
pub const ACQUIRED_TOTAL: &str = "keyed_lock_acquired_total";
/// Counter of rejected requests.
pub const REJECTED_TOTAL: &str = "keyed_lock_rejected_total";
/// Gauge of requests waiting for a key now.
pub const WAITING: &str = "keyed_lock_waiting";
/// Gauge of keys that have a holder or a waiter now.
pub const KEYS: &str = "keyed_lock_keys";
/// Counter of leases lost while held (distributed backends).
pub const LEASE_LOST_TOTAL: &str = "keyed_lock_lease_lost_total";

/// The [`REJECTED_TOTAL`] counters of one `name`, one per [`RejectionKind`]: the lock
/// layer and the replay layer under it count into the same series.
pub(crate) struct Rejected([Counter; RejectionKind::ALL.len()]);

impl Rejected {
    pub(crate) fn new(name: &metrics::SharedString) -> Self {
        Self(RejectionKind::ALL.map(|kind| {
            metrics::counter!(REJECTED_TOTAL, "name" => name.clone(), "reason" => kind.as_str())
        }))
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
    pub(crate) lease_lost: Counter,
}

impl Metrics {
    pub(crate) fn new(name: &str) -> Self {
        describe();
        let name = metrics::SharedString::from(name.to_owned());
        let rejected = Rejected::new(&name);
        Self {
            wait_acquired: metrics::histogram!(WAIT_SECONDS, "name" => name.clone(), "outcome" => "acquired"),
            wait_timeout: metrics::histogram!(WAIT_SECONDS, "name" => name.clone(), "outcome" => "timeout"),
            wait_queue_full: metrics::histogram!(WAIT_SECONDS, "name" => name.clone(), "outcome" => "queue_full"),
            wait_cancelled: metrics::histogram!(WAIT_SECONDS, "name" => name.clone(), "outcome" => "cancelled"),
            hold: metrics::histogram!(HOLD_SECONDS, "name" => name.clone()),
            acquired_uncontended: metrics::counter!(ACQUIRED_TOTAL, "name" => name.clone(), "contended" => "false"),
            acquired_contended: metrics::counter!(ACQUIRED_TOTAL, "name" => name.clone(), "contended" => "true"),
            rejected,
            waiting: metrics::gauge!(WAITING, "name" => name.clone()),
            keys: metrics::gauge!(KEYS, "name" => name.clone()),
            lease_lost: metrics::counter!(LEASE_LOST_TOTAL, "name" => name),
        }
    }

    pub(crate) fn rejected(&self, kind: RejectionKind) {
        self.rejected.increment(kind);
    }
}

fn describe() {
    metrics::describe_histogram!(
        WAIT_SECONDS,
        Unit::Seconds,
        "Time from a request's arrival to its key guard, its rejection or its cancellation."
    );
    metrics::describe_histogram!(HOLD_SECONDS, Unit::Seconds, "Time a key guard was held.");
    metrics::describe_counter!(
        ACQUIRED_TOTAL,
        "Key guards acquired, by whether the request had to wait."
    );
    metrics::describe_counter!(
        REJECTED_TOTAL,
        "Requests answered by the lock layer instead of the service, by reason."
    );
    metrics::describe_gauge!(WAITING, "Requests waiting for a key now.");
    metrics::describe_gauge!(KEYS, "Keys with a holder or a waiter now.");
    metrics::describe_counter!(LEASE_LOST_TOTAL, "Distributed leases lost while held.");
}

#[cfg(test)]
mod tests {
    use crate::reject::RejectionKind;

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
