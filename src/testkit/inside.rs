//! Who is inside each key now, as a check sees it. The guarantee is no *unsignalled*
//! overlap: a second holder of a key fails the check unless every holder already
//! inside had lost its lease (a loaded engine can end a lease early, and says so).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::LeaseSignal;

/// A holder inside a key: its ticket, and its lease signal (none in process).
type Holder = (u64, Option<LeaseSignal>);

pub(super) struct Inside {
    /// Per key: the holders inside.
    keys: Mutex<Vec<Vec<Holder>>>,
    next: AtomicU64,
}

impl Inside {
    pub(super) fn new(keys: usize) -> Self {
        Inside {
            keys: Mutex::new(vec![Vec::new(); keys]),
            next: AtomicU64::new(0),
        }
    }

    /// Enters `key` with the holder's `lease`; panics with `what` if another holder is
    /// inside whose lease is not lost. The ticket leaves with [`leave`](Self::leave).
    pub(super) fn enter(&self, key: usize, lease: Option<&LeaseSignal>, what: &str) -> u64 {
        let ticket = self.next.fetch_add(1, Relaxed);
        let mut keys = self.keys.lock().unwrap();
        let unsignalled = keys[key]
            .iter()
            .any(|(_, other)| !other.as_ref().is_some_and(LeaseSignal::is_lost));
        assert!(
            !unsignalled,
            "conformance: {what}, the first not told its lease was lost"
        );
        if !keys[key].is_empty() {
            tracing::info!("conformance: {what}, after the first's lease was lost (allowed)");
        }
        keys[key].push((ticket, lease.cloned()));
        ticket
    }

    pub(super) fn leave(&self, key: usize, ticket: u64) {
        self.keys.lock().unwrap()[key].retain(|(held, _)| *held != ticket);
    }
}
