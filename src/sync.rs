//! Synchronization primitives, swapped for `loom`'s under `cfg(loom)` so the model
//! checker can explore every interleaving of the lock table.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc, Mutex, MutexGuard,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc, Mutex, MutexGuard,
};

/// Locks `mutex`, ignoring poisoning: no code that can panic runs under these locks,
/// and a poisoned waiter state is still consistent.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
