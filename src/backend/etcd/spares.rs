//! Leases granted ahead: an acquisition takes one that is ready instead of waiting for
//! its own grant, a Raft write, and has another granted in the background for the
//! next. The write is still made once per lock, but off the lock's path: an
//! uncontended lock waits for two writes (the queue transaction, then the revocation at
//! its release) instead of three, and on a hot key the next holder is queued one write
//! sooner.
//!
//! A spare is a lease with no key attached, so it holds nothing and blocks nobody; it
//! counts as granted when its grant was sent, as the acquisition's own grant does (the
//! validity and the first keep-alive run from then), and is taken only while it has
//! most of its lease left. The pool follows the acquisitions in flight: each one that
//! starts has one granted for the one after it, up to [`MAX_SPARES`]; when they stop,
//! the spares left expire at etcd with their TTL.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::{timeout, Instant};

use super::Inner;

/// The most spares a backend keeps (or has being granted) at once.
pub(super) const MAX_SPARES: usize = 64;

/// A backend's spare leases: `(lease id, when its grant was sent)`.
#[derive(Default)]
pub(super) struct Spares {
    ready: Mutex<Vec<(i64, Instant)>>,
    /// Grants sent and not answered yet.
    granting: AtomicUsize,
}

impl Spares {
    /// The newest spare granted less than `fresh_for` ago, if any; older ones are
    /// dropped (they expire at etcd).
    pub(super) fn take(&self, fresh_for: Duration) -> Option<(i64, Instant)> {
        let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        ready.retain(|&(_, sent)| now < sent + fresh_for);
        ready.pop()
    }

    fn put(&self, lease: i64, sent: Instant) {
        let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        if ready.len() < MAX_SPARES {
            ready.push((lease, sent));
        }
    }

    fn count(&self) -> usize {
        let ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        ready.len() + self.granting.load(Ordering::Relaxed)
    }
}

impl Inner {
    /// Has one more spare granted in the background, unless there are enough. A grant
    /// that fails or goes unanswered leaves none (the next acquisition grants its own).
    pub(super) fn grant_spare(self: &Arc<Self>) {
        if self.spares.count() >= MAX_SPARES {
            return;
        }
        let granting = Granting::start(self.clone());
        tokio::spawn(async move {
            let inner = &granting.0;
            let mut leases = inner.client.lease_client();
            let sent = Instant::now();
            let grant = timeout(inner.config.command_timeout, leases.grant(inner.ttl, None));
            if let Ok(Ok(granted)) = grant.await {
                if granted.ttl() > 0 {
                    inner.spares.put(granted.id(), sent);
                }
            }
        });
    }
}

/// One spare being granted, counted until its task ends (or is dropped with its
/// runtime).
struct Granting(Arc<Inner>);

impl Granting {
    fn start(inner: Arc<Inner>) -> Self {
        inner.spares.granting.fetch_add(1, Ordering::Relaxed);
        Self(inner)
    }
}

impl Drop for Granting {
    fn drop(&mut self) {
        self.0.spares.granting.fetch_sub(1, Ordering::Relaxed);
    }
}
