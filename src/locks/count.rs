//! The bound on a table's keys (`max_keys`), and the stripe of the calling thread.
//!
//! The table counts its keys per shard under the shard locks (`table.rs`), which costs
//! no atomic read-modify-write; only a bounded table also keeps the shared counter here.

use crate::sync::{AtomicUsize, CachePadded, Ordering};

/// The table's handles (`locks.rs`): a thread uses its own stripe, so two cores
/// locking and releasing do not fight over one reference count. A power of two.
pub(super) const STRIPES: usize = 16;

/// `max_keys`: one counter, raised before a key is inserted, so concurrent inserts on
/// different shards cannot overshoot the bound.
pub(crate) struct KeyBound {
    count: CachePadded<AtomicUsize>,
    max: usize,
}

impl KeyBound {
    /// `None` for `usize::MAX`: no bound, nothing to count.
    pub(crate) fn new(max_keys: usize) -> Option<Self> {
        (max_keys != usize::MAX).then(|| KeyBound {
            count: CachePadded(AtomicUsize::new(0)),
            max: max_keys,
        })
    }

    /// Counts a key about to be inserted, or refuses it when the table is full.
    pub(crate) fn admit(&self) -> bool {
        let admitted = self.count.fetch_add(1, Ordering::AcqRel) < self.max;
        if !admitted {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        admitted
    }

    /// Uncounts a removed key.
    pub(crate) fn removed(&self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// This thread's stripe, handed out round-robin on first use.
pub(super) fn stripe() -> usize {
    use std::sync::atomic::AtomicUsize as StdAtomicUsize;
    static NEXT: StdAtomicUsize = StdAtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|stripe| *stripe)
}
