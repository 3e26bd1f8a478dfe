//! Several keys at once across instances: [`DistributedLocks::lock_all`] and
//! [`DistributedGuards`].
//!
//! Keys are taken one by one, each in both tiers, in byte order of the key text: the
//! one order every instance computes alike (a table hash is random per process), so two
//! callers anywhere that want overlapping sets never each hold what the other waits
//! for.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::{DistributedGuard, DistributedLocks, LeaseLost};
use crate::backend::LostReason;
use crate::error::LockError;
use crate::key::Key;
use crate::locks::Mode;

/// Holds every key of a [`DistributedLocks::lock_all`] call; dropping it releases them
/// all (remotely first, as [`DistributedGuard`] does).
#[must_use = "the keys are released as soon as the guard is dropped"]
pub struct DistributedGuards {
    /// In the order taken: byte order of the keys.
    guards: Vec<DistributedGuard>,
}

impl DistributedGuards {
    /// The guard of each key, in the order taken (byte order of the keys): each with
    /// its own fencing token and lease.
    pub fn guards(&self) -> &[DistributedGuard] {
        &self.guards
    }

    /// The keys held, in byte order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.guards.iter().map(DistributedGuard::key)
    }

    /// Whether any key's lease was lost: another instance may hold that key now.
    pub fn is_lost(&self) -> bool {
        self.guards.iter().any(DistributedGuard::is_lost)
    }

    /// Runs `work` while every key is held, and cancels it (drops it) as soon as any
    /// key's lease is lost.
    pub async fn run_while_held<F: Future>(&self, work: F) -> Result<F::Output, LeaseLost> {
        if let Some(lost) = self.first_lost() {
            return Err(lost);
        }
        let any_lost = async {
            let mut lost: Vec<_> = self
                .guards
                .iter()
                .map(|guard| Box::pin(guard.lost()))
                .collect();
            std::future::poll_fn(|cx| {
                match lost
                    .iter_mut()
                    .any(|lost| lost.as_mut().poll(cx).is_ready())
                {
                    true => std::task::Poll::Ready(()),
                    false => std::task::Poll::Pending,
                }
            })
            .await
        };
        tokio::select! {
            biased;
            () = any_lost => Err(self.first_lost().unwrap_or(LeaseLost::new(LostReason::Expired))),
            output = work => Ok(output),
        }
    }

    /// The loss of the first key found lost, if any.
    fn first_lost(&self) -> Option<LeaseLost> {
        self.guards
            .iter()
            .find(|guard| guard.is_lost())
            .map(DistributedGuard::lease_lost)
    }

    /// Releases every key and waits until the backend has them back.
    pub async fn release(self) {
        for guard in self.guards {
            guard.release().await;
        }
    }
}

impl fmt::Debug for DistributedGuards {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.guards).finish()
    }
}

impl DistributedLocks {
    /// Waits for every key of `keys`, without a time limit, in this process and at the
    /// backend, and holds them all under one guard: a transfer between two accounts
    /// holds both, whichever instance runs it.
    ///
    /// Keys are taken in byte order (not the order given), the same on every instance,
    /// so two calls for `[a, b]` and `[b, a]` cannot deadlock each other; duplicates
    /// are taken once. Every key is checked before any is taken. Cancel-safe: dropped at
    /// any point, it releases what it had taken. An empty `keys` holds nothing.
    ///
    /// ```no_run
    /// # use tower_keyed_lock::DistributedLocks;
    /// # async fn run(accounts: DistributedLocks) -> Result<(), tower_keyed_lock::LockError> {
    /// let both = accounts.lock_all(["alice", "bob"]).await?;
    /// let tokens: Vec<_> = both.guards().iter().map(|guard| guard.fencing_token()).collect();
    /// // … move the money, writing with those tokens …
    /// both.release().await;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lock_all<S: AsRef<str>>(
        &self,
        keys: impl IntoIterator<Item = S>,
    ) -> Result<DistributedGuards, LockError> {
        self.take_all(keys, None, false).await
    }

    /// Waits for every key of `keys` at most `timeout` in all, then fails with
    /// [`LockError::Timeout`], releasing what it had taken.
    pub async fn lock_all_timeout<S: AsRef<str>>(
        &self,
        keys: impl IntoIterator<Item = S>,
        timeout: Duration,
    ) -> Result<DistributedGuards, LockError> {
        self.take_all(keys, Some(Instant::now() + timeout), false)
            .await
    }

    /// Takes every key of `keys` if none is held, here or on another instance; else
    /// fails with [`LockError::Busy`] and holds none of them.
    pub async fn try_lock_all<S: AsRef<str>>(
        &self,
        keys: impl IntoIterator<Item = S>,
    ) -> Result<DistributedGuards, LockError> {
        // A deadline already passed: each key is tried once, a held one is `Busy`.
        self.take_all(keys, Some(Instant::now()), true).await
    }

    async fn take_all<S: AsRef<str>>(
        &self,
        keys: impl IntoIterator<Item = S>,
        deadline: Option<Instant>,
        try_once: bool,
    ) -> Result<DistributedGuards, LockError> {
        let mut keys = keys
            .into_iter()
            .map(|key| Key::new(key.as_ref(), self.inner.max_key_len))
            .collect::<Result<Vec<_>, _>>()
            .map_err(LockError::InvalidKey)?;
        keys.sort_unstable_by(|a, b| a.as_str().cmp(b.as_str()));
        keys.dedup();
        let mut guards = Vec::with_capacity(keys.len());
        for key in keys {
            let timeout =
                deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
            match self.acquire(key, timeout, Mode::Exclusive, None).await {
                Ok(guard) => guards.push(guard),
                // A key reached with no time left is tried once, which says `Busy`.
                Err(LockError::Busy) if !try_once => return Err(LockError::Timeout),
                // What was taken is released as `guards` drops.
                Err(error) => return Err(error),
            }
        }
        Ok(DistributedGuards { guards })
    }
}
