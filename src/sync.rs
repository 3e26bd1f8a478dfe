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

/// Keeps a value on cache lines of its own (128 bytes covers the adjacent-line
/// prefetcher of x86 and the 128-byte lines of Apple silicon), so that writes to it do
/// not slow down readers of its neighbours.
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}
