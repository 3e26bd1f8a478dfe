//! Leader election on any backend: [`LeaderElection`], [`Leadership`].

use std::future::Future;
use std::time::Duration;

use super::{DistributedGuard, DistributedLocks, LeaseLost};
use crate::backend::Holder;
use crate::error::LockError;

/// Leader election among the instances that share a [`DistributedLocks`]' backend: the
/// leader is whoever holds one key. Campaigning waits for the key, stepping down
/// releases it, and a lost lease ends the leadership; so it works on every backend
/// (and in process) with no engine code of its own. Cheap to clone.
///
/// ```
/// use tower_keyed_lock::{DistributedLocks, LeaderElection};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let locks = DistributedLocks::in_process("scheduler"); // or `new("scheduler", backend)`
/// let election = LeaderElection::new(locks.clone(), "leader");
/// let rival = LeaderElection::new(locks, "leader");
///
/// let leadership = election.campaign().await.unwrap();
/// assert!(rival.try_campaign().await.is_err()); // one leader at a time
/// println!("the leader: {}", election.leader().await.unwrap().unwrap());
///
/// leadership.step_down().await;
/// let next = rival.try_campaign().await.unwrap(); // the other takes over
/// # drop(next);
/// # }
/// ```
///
/// # A lost leadership
///
/// A leader whose lease is lost (the engine became unreachable, its runtime stalled
/// past the lease, its session expired) must stop acting as leader at once: another
/// candidate may be leader already. [`Leadership::lost`] resolves then, and
/// [`Leadership::is_lost`] turns true by the clock alone;
/// [`run_as_leader`](LeaderElection::run_as_leader) drops the leader's work at that
/// moment. Campaigning again afterwards is the caller's choice: call
/// [`campaign`](LeaderElection::campaign) again (in a loop, to stay a candidate).
///
/// # Shutdown
///
/// When the locks' [`shutdown`](DistributedLocks::shutdown) begins, the leader steps
/// down at once: its lease is given back and its leadership lost
/// ([`LostReason::ShutDown`](crate::backend::LostReason::ShutDown)), so a candidate on
/// another instance is elected while this one drains, instead of at the shutdown's
/// deadline. The leader's work, told through [`Leadership::lost`] (or dropped by
/// [`run_as_leader`](LeaderElection::run_as_leader)), should stop then. In process there
/// is no lease to give back, and no other instance to hand over to.
///
/// # Failover after a crash, and choosing the lease
///
/// A leader that stops without stepping down — its process killed, its host gone —
/// gives nothing back: the next candidate is elected when the engine lets its lease go.
/// On a lease-based engine (Redis, DynamoDB, etcd, Azure Blob) that is when the lease
/// runs out: up to one lease after the leader's last renewal (renewals run every
/// lease/3, so between two thirds of a lease and a whole lease after the crash). On a
/// session engine it is when the engine sees the session end: at once when the dead
/// process's connection is closed by its operating system (PostgreSQL, MySQL); for a
/// host that vanished, within the server-side idle limit of PostgreSQL (a liveness
/// interval plus two network timeouts; see its module docs) and the session timeout of
/// ZooKeeper. That bound plays the lease's part below. A graceful
/// [`shutdown`](DistributedLocks::shutdown) or [`step_down`](Leadership::step_down)
/// hands over at once.
///
/// So the lease is the longest time without a leader after a crash. Shorter is faster
/// failover but more renewal traffic, and a leader whose process stalls (a GC-like
/// pause, CPU starvation, a slow network) longer than the lease loses its leadership —
/// a lost signal, never two leaders at once, but a wasted term. Choose a lease a few
/// times the longest stall you expect from the leader's process and the engine's round
/// trip (seconds to tens of seconds: 10 s to 30 s is common), and no longer than the
/// time without a leader the work can bear. The [fencing token](Leadership::fencing_token)
/// protects what the leader writes from a predecessor that did not yet notice it was
/// replaced.
#[derive(Clone, Debug)]
pub struct LeaderElection {
    locks: DistributedLocks,
    key: String,
}

/// Being the leader: the election's key, held. Dropping it steps down (in the
/// background); [`step_down`](Self::step_down) waits until the backend has the key
/// back.
#[derive(Debug)]
#[must_use = "dropping the leadership steps down at once"]
pub struct Leadership {
    guard: DistributedGuard,
}

impl LeaderElection {
    /// An election on `key` of `locks`.
    pub fn new(locks: DistributedLocks, key: impl Into<String>) -> Self {
        Self {
            locks,
            key: key.into(),
        }
    }

    /// The key whose holder is the leader.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Waits until this candidate is the leader, without a time limit.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future at any point leaves nothing held: it is a
    /// [`DistributedLocks::lock`].
    pub async fn campaign(&self) -> Result<Leadership, LockError> {
        let guard = self.locks.lock(&self.key).await?;
        Ok(Leadership::new(guard))
    }

    /// Waits at most `timeout` to become the leader, then fails with
    /// [`LockError::Timeout`].
    pub async fn campaign_timeout(&self, timeout: Duration) -> Result<Leadership, LockError> {
        let guard = self.locks.lock_timeout(&self.key, timeout).await?;
        Ok(Leadership::new(guard))
    }

    /// Becomes the leader only if there is none now; else fails with
    /// [`LockError::Busy`].
    pub async fn try_campaign(&self) -> Result<Leadership, LockError> {
        let guard = self.locks.try_lock(&self.key).await?;
        Ok(Leadership::new(guard))
    }

    /// The current leader as the backend sees it, `None` when there is none: see
    /// [`DistributedLocks::holder`] for what each backend can tell.
    pub async fn leader(&self) -> Result<Option<Holder>, LockError> {
        self.locks.holder(&self.key).await
    }

    /// Campaigns, then runs `work` as the leader and steps down when it ends. If the
    /// leadership is lost first, `work` is dropped at once and the result is
    /// `Ok(Err(LeaseLost))`; campaigning again is the caller's choice.
    ///
    /// ```
    /// use tower_keyed_lock::{DistributedLocks, LeaderElection};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let election = LeaderElection::new(DistributedLocks::in_process("jobs"), "leader");
    /// let result = election
    ///     .run_as_leader(|leadership| async move {
    ///         // The fencing token orders the writes of successive leaders.
    ///         leadership.fencing_token()
    ///     })
    ///     .await;
    /// assert_eq!(result.unwrap().unwrap(), None); // in process: no fencing tokens
    /// # }
    /// ```
    pub async fn run_as_leader<F, Fut>(
        &self,
        work: F,
    ) -> Result<Result<Fut::Output, LeaseLost>, LockError>
    where
        F: FnOnce(LeaderInfo) -> Fut,
        Fut: Future,
    {
        let leadership = self.campaign().await?;
        let info = LeaderInfo {
            fencing_token: leadership.fencing_token(),
        };
        let outcome = leadership.guard.run_while_held(work(info)).await;
        leadership.step_down().await;
        Ok(outcome)
    }
}

/// What [`run_as_leader`](LeaderElection::run_as_leader)'s work knows of its
/// leadership.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LeaderInfo {
    fencing_token: Option<u64>,
}

impl LeaderInfo {
    /// The fencing token of this leadership: it grows with every new leader, so
    /// storage can refuse the writes of an older one. `None` in process and from a
    /// backend that issues none.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }
}

impl Leadership {
    /// The leadership of the election's key, held by `guard`: cut off as soon as the
    /// locks' shutdown begins, not at its deadline.
    fn new(guard: DistributedGuard) -> Self {
        guard.cut_off_when_shutdown_begins();
        Self { guard }
    }

    /// The election's key.
    pub fn key(&self) -> &str {
        self.guard.key()
    }

    /// The fencing token of this leadership (see [`LeaderInfo::fencing_token`]).
    pub fn fencing_token(&self) -> Option<u64> {
        self.guard.fencing_token()
    }

    /// Whether the leadership was lost: another candidate may be leader now. Read by
    /// the clock alone. Never true in process.
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Resolves when the leadership is lost; never in process, nor after a step-down.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it only reads the lease's signal.
    pub async fn lost(&self) {
        self.guard.lost().await;
    }

    /// Steps down: releases the key and waits until the backend has it back, so the
    /// next candidate can be elected at once.
    pub async fn step_down(self) {
        self.guard.release().await;
    }

    /// The guard of the election's key, for what [`DistributedGuard`] offers beyond
    /// this type (such as [`run_while_held`](DistributedGuard::run_while_held)).
    pub fn guard(&self) -> &DistributedGuard {
        &self.guard
    }
}
