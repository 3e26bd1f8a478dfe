//! The replay layer's metrics; each carries the lock layer's `name` label, never a key.
//!
//! | metric | kind |
//! |---|---|
//! | [`REPLAYED_TOTAL`] | counter: responses replayed from the store |
//! | [`STORED_TOTAL`] | counter: responses written to the store |
//! | [`REJECTED_TOTAL`](crate::metrics::REJECTED_TOTAL) | `reason` = `fingerprint_mismatch` \| `backend` (store unreachable) \| `misconfigured` \| `body_too_large` \| `body_unread` |

use metrics::Counter;

use crate::metrics::{naming, Naming, Rejected};
use crate::reject::RejectionKind;

pub use crate::metrics::{REPLAYED_TOTAL, STORED_TOTAL};

/// The handles of one replay layer under one lock layer name.
pub(crate) struct ReplayMetrics {
    pub(crate) replayed: Counter,
    pub(crate) stored: Counter,
    rejected: Rejected,
}

impl ReplayMetrics {
    pub(crate) fn new(name: &str) -> Self {
        let name = metrics::SharedString::from(name.to_owned());
        let (replayed, stored) = match naming() {
            Naming::Prometheus => (REPLAYED_TOTAL, STORED_TOTAL),
            Naming::OpenTelemetry => ("keyed_lock.replayed", "keyed_lock.stored"),
        };
        metrics::describe_counter!(replayed, "Responses replayed from the replay store.");
        metrics::describe_counter!(stored, "Responses written to the replay store.");
        Self {
            replayed: metrics::counter!(replayed, "name" => name.clone()),
            stored: metrics::counter!(stored, "name" => name.clone()),
            rejected: Rejected::new(&name),
        }
    }

    pub(crate) fn rejected(&self, kind: RejectionKind) {
        self.rejected.increment(kind);
    }
}
