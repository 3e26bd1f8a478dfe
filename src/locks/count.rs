//! The number of keys in a table: exact and shared when it is bounded, striped when not.

use crate::sync::{AtomicUsize, CachePadded, Ordering};

/// Counters of the unbounded kind, and the table's handles (`locks.rs`): a thread uses
/// its own stripe, so two cores inserting and removing keys do not fight over one
/// cache line. A power of two.
pub(super) const STRIPES: usize = 16;

pub(crate) enum KeyCount {
    /// `max_keys` is set: one counter, raised before a key is inserted, so concurrent
    /// inserts on different shards cannot overshoot the bound.
    Bounded {
        count: CachePadded<AtomicUsize>,
        max: usize,
    },
    /// No bound: only `len()` reads the count, by summing the stripes.
    Unbounded(Box<[CachePadded<AtomicUsize>]>),
}

impl KeyCount {
    pub(crate) fn new(max_keys: usize) -> Self {
        if max_keys == usize::MAX {
            KeyCount::Unbounded(
                (0..STRIPES)
                    .map(|_| CachePadded(AtomicUsize::new(0)))
                    .collect(),
            )
        } else {
            KeyCount::Bounded {
                count: CachePadded(AtomicUsize::new(0)),
                max: max_keys,
            }
        }
    }

    /// Counts a key about to be inserted, or refuses it when the table is full.
    pub(crate) fn admit(&self) -> bool {
        match self {
            KeyCount::Bounded { count, max } => {
                let admitted = count.fetch_add(1, Ordering::AcqRel) < *max;
                if !admitted {
                    count.fetch_sub(1, Ordering::AcqRel);
                }
                admitted
            }
            KeyCount::Unbounded(stripes) => {
                stripes[stripe()].fetch_add(1, Ordering::AcqRel);
                true
            }
        }
    }

    /// Uncounts a removed key.
    pub(crate) fn removed(&self) {
        match self {
            KeyCount::Bounded { count, .. } => count.fetch_sub(1, Ordering::AcqRel),
            // A stripe may go "below zero" (wrapping): only the sum has a meaning.
            KeyCount::Unbounded(stripes) => stripes[stripe()].fetch_sub(1, Ordering::AcqRel),
        };
    }

    /// The number of keys; exact whenever no insert or removal is in flight.
    pub(crate) fn get(&self) -> usize {
        match self {
            KeyCount::Bounded { count, .. } => count.load(Ordering::Acquire),
            KeyCount::Unbounded(stripes) => {
                let sum = stripes.iter().fold(0usize, |sum, stripe| {
                    sum.wrapping_add(stripe.load(Ordering::Acquire))
                });
                // Read stripe by stripe, a removal can be seen before the insert it
                // follows: a sum "below zero" is an empty table.
                if sum > isize::MAX as usize {
                    0
                } else {
                    sum
                }
            }
        }
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
