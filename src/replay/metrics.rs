//! The replay layer's metrics; each carries the lock layer's `name` label, never a key.
//!
//! | metric | kind |
//! |---|---|
//! | [`REPLAYED_TOTAL`] | counter: responses replayed from the store |
//! | [`STORED_TOTAL`] | counter: responses written to the store |
//! | [`REJECTED_TOTAL`](crate::metrics::REJECTED_TOTAL) | `reason` = `fingerprint_mismatch` \| `backend` (store unreachable) \| `misconfigured` \| `body_too_large` \| `body_unread` |

use metrics::Counter;

use crate::metrics::REJECTED_TOTAL;
use crate::reject::RejectionKind;

/// Counter of responses replayed from the store.
pub const REPLAYED_TOTAL: &str = "keyed_lock_replayed_total";
/// Counter of responses written to the store.
pub const STORED_TOTAL: &str = "keyed_lock_stored_total";

/// The kinds of rejection the replay layer answers with.
const KINDS: [RejectionKind; 5] = [
    RejectionKind::FingerprintMismatch,
    RejectionKind::Backend,
    RejectionKind::Misconfigured,
    RejectionKind::BodyTooLarge,
    RejectionKind::BodyUnread,
];

/// The handles of one replay layer.
pub(crate) struct ReplayMetrics {
    pub(crate) replayed: Counter,
    pub(crate) stored: Counter,
    rejected: [(RejectionKind, Counter); KINDS.len()],
}

impl ReplayMetrics {
    pub(crate) fn new(name: &str) -> Self {
        let name = metrics::SharedString::from(name.to_owned());
        metrics::describe_counter!(REPLAYED_TOTAL, "Responses replayed from the replay store.");
        metrics::describe_counter!(STORED_TOTAL, "Responses written to the replay store.");
        Self {
            replayed: metrics::counter!(REPLAYED_TOTAL, "name" => name.clone()),
            stored: metrics::counter!(STORED_TOTAL, "name" => name.clone()),
            rejected: KINDS.map(|kind| {
                let counter =
                    metrics::counter!(REJECTED_TOTAL, "name" => name.clone(), "reason" => kind.as_str());
                (kind, counter)
            }),
        }
    }

    pub(crate) fn rejected(&self, kind: RejectionKind) {
        if let Some((_, counter)) = self.rejected.iter().find(|(k, _)| *k == kind) {
            counter.increment(1);
        }
    }
}
