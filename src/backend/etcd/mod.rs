//! etcd backend: serializes a key across every instance that shares an etcd cluster,
//! with a lease per holder, waiters queued in arrival order across instances, and the
//! cluster-wide revision as fencing token.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_keyed_lock::backend::{etcd::EtcdBackend, SetupError};
//! use tower_keyed_lock::{DistributedLocks, KeyedLockLayer};
//!
//! # async fn run() -> Result<(), SetupError> {
//! let endpoints = ["http://etcd-0:2379", "http://etcd-1:2379", "http://etcd-2:2379"];
//! let backend = EtcdBackend::builder(endpoints)
//!     .lease(Duration::from_secs(10))
//!     .build()
//!     .await?;
//! // Requests with one idempotency key run one at a time, across every instance…
//! let layer = KeyedLockLayer::by_header("idempotency-key")
//!     .name("orders")
//!     .wait_timeout(Duration::from_secs(2))
//!     .backend(backend.clone());
//! // …and so do jobs, outside HTTP.
//! let jobs = DistributedLocks::builder("jobs").backend(backend).build();
//! if let Ok(guard) = jobs.try_lock("nightly-report").await {
//!     // Only this instance runs it; `guard.fencing_token()` orders its writes.
//!     guard.release().await;
//! }
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! The client is [`etcd_client`] (gRPC over tonic, the v3 API with leases, watches,
//! transactions and the lock service): its build compiles etcd's protobuf files with
//! `protoc` (Debian and Ubuntu: `apt-get install protobuf-compiler`; elsewhere set
//! `PROTOC`).
//!
//! # etcd keys
//!
//! A layer named `name` locks request key `key` with a queue of etcd keys under
//!
//! ```text
//! <prefix><name>/<key>/                      the lock's queue (a key range)
//! <prefix><name>/<key>/<lease id, 16 hex>    one contender (holder or waiter), attached
//!                                            to its own etcd lease, empty value
//! ```
//!
//! `name` and `key` are each written with every byte outside ASCII letters, digits and
//! `- _ . ~ : @ + = ,` escaped as `%XX` (so `/`, `%`, `#`, spaces and non-ASCII never
//! appear raw); when the escaped form is empty or longer than 128 bytes, it is `#`
//! followed by the lowercase hex SHA-256 of the UTF-8 bytes instead (stable across
//! builds and machines). Neither form holds a `/`, and an escaped form never starts
//! with `#`: distinct (name, key) pairs under one prefix never share a queue, nor is
//! one queue a prefix of another. The prefix (default [`DEFAULT_PREFIX`],
//! `"keyed-lock/"`) gets a trailing `/` if it has none; applications that share a
//! cluster keep apart by prefixes neither of which starts with the other.
//! [`EtcdBackend::queue_prefix`] computes a queue's prefix.
//!
//! # How a key is held
//!
//! This is etcd's own lock recipe (`clientv3/concurrency.Mutex`), with its timing
//! made explicit:
//!
//! - **Lease.** Each acquisition has an etcd lease of its own
//!   ([`lease`](EtcdBackendBuilder::lease), rounded up to whole seconds, as etcd counts
//!   them; etcd may grant a longer one, never a shorter): one granted ahead, in the
//!   background, while that one has more than two thirds of its lease left (counted
//!   from when its grant was sent, as any grant), else one granted then. Either way one
//!   more is granted ahead for the next, so a lock waits for two Raft writes, not three.
//!   A lease granted ahead has no key, holds nothing, and expires by itself if unused.
//! - **Queue.** One transaction puts the contender's key, attached to that lease, and
//!   reads the oldest key of the queue. The key's create revision is its place in the
//!   queue: etcd's revision is one counter for the whole cluster, raised by every
//!   write, so places are unique and ordered by arrival at the Raft leader. If the
//!   oldest key is the contender's own, the lock is granted.
//! - **Wait.** Otherwise the waiter watches the newest key older than its own (its
//!   predecessor only: one release wakes one waiter, no herd), from when etcd makes the
//!   watch, and looks again once it is made, so a deletion in between is not missed (a
//!   watch from an earlier revision is one etcd catches up on every 100 ms only). When it is deleted (released,
//!   revoked, expired, or the predecessor gave up) the waiter looks again, and holds the
//!   lock once no older key is left. Keys pass in FIFO order across instances. A watch
//!   that breaks, and a jittered [`poll_interval`](EtcdBackendBuilder::poll_interval),
//!   make the waiter look again too: a lost watch only costs latency. Only the request's
//!   wait bounds the waiting, never a number of attempts nor a failure that can pass
//!   (see [Transient failures](self#transient-failures)); at its end the waiter's lease
//!   is revoked, which removes its key from the queue.
//! - **Fencing token.** The holder key's create revision
//!   ([`LockInfo::fencing_token`](crate::LockInfo::fencing_token)): strictly
//!   increasing from holder to holder, since holders are granted in queue order.
//! - **Validity.** The lease counts as valid until *send time of the grant, or of the
//!   last keep-alive that was answered, + lease − drift margin*, on the monotonic clock.
//!   At that instant it is declared lost (even if etcd never answers again), as it is
//!   at the first answer saying the lease is gone or the key is not there; the handler
//!   sees it through [`LockInfo::lease`](crate::LockInfo::lease). etcd counts the
//!   lease from when the leader received the same request, later, and with a TTL at
//!   least as long: the holder gives up first, modulo clock drift.
//! - **Renewal.** From the grant on (waiters too, so a long wait keeps its place), a
//!   keep-alive every lease/3 on one keep-alive stream kept open for the lease (one
//!   message each way; a stream that failed or timed out is dropped and a new one
//!   opened, so a late answer never counts for a later send). A holder also watches
//!   its own key: when it is deleted (by hand, or with its lease revoked), the lease is
//!   declared lost at once, not at the next renewal. Renewal stops when the lease is
//!   released, dropped or lost.
//! - **Watches.** A backend's watches, the holders' on their own keys and the
//!   waiters' on their predecessors', share one watch stream: each is a watch of its
//!   own on it, ended by the deletion it waits for or by a waiter that stops waiting.
//!   A broken stream is opened again with each holder's watch from the revision after
//!   its grant; its waiters look again. etcd keeps one watcher per held key and per
//!   waiter, none after.
//! - **Release.** The lease is revoked, which deletes the key with it: the next waiter's
//!   watch fires. If etcd cannot be reached within the command timeout, the revocation
//!   is retried in the background until the lease would have expired anyway.
//! - **Cancel safety.** From the moment the lease is granted, a guard revokes it if the
//!   acquisition ends without handing it over (an error, the wait over, the acquire
//!   future dropped at any await). A grant whose answer never came leaves a lease with no
//!   key attached, which expires by itself and blocks nobody.
//!
//! # Transient failures
//!
//! Every request is bounded by [`command_timeout`](EtcdBackendBuilder::command_timeout).
//! One that fails for a reason that can pass — no answer in time, a member down,
//! restarting or unreachable, a connection reset or broken, a leader election or no
//! leader, etcd overloaded — is sent again after a short jittered pause (the client
//! then picks a member that answers), and a waiter whose look at the queue failed looks
//! again after a jittered pause growing from 25–50 ms to the poll interval, keeping its
//! lease alive meanwhile: it keeps its place for as long as etcd keeps its lease. A
//! definite answer (the lease not found, a request etcd refuses) ends the step at once;
//! a waiter whose lease etcd no longer has queues again with a new one, behind those
//! who queued meanwhile. Only the wait ends the waiting: when etcd stays down or silent,
//! an acquisition fails with [`LockError::Backend`] at the end of its wait (a zero wait
//! after one command timeout), and the layer answers 503 (or runs the request under its
//! local lock with [`fail_open`](crate::KeyedLockLayer::fail_open)); it fails with
//! [`LockError::Timeout`] if etcd answered its last look.
//!
//! # Who holds a key
//!
//! [`holder`](LockBackend::holder) reads the oldest key of the queue (the holder) and
//! its lease: the key's value is the holder's instance id
//! ([`instance_id`](EtcdBackendBuilder::instance_id)), put by the transaction that
//! joined the queue; its create revision is the fencing token; the lease's time to live
//! (whole seconds, as etcd counts them) is `lease_left`. etcd records no time, so
//! `since` is `None`.
//!
//! # Timing rules
//!
//! | what | when |
//! |---|---|
//! | keep-alive (holders and waiters) | every lease/3 after the last answered one; retried every lease/12 while unanswered |
//! | a holder counts its lease lost | send time of the last answered grant or keep-alive + lease − drift margin (default 1% of the lease + 2 ms), or at the first "lease not found", or at once when its watch sees its key deleted |
//! | etcd frees a stopped holder's key | one granted TTL after the leader last heard of it; a new leader adds up to an election timeout |
//! | one request (grant, transaction, read, keep-alive, revoke) | at most the command timeout (default 1 s) |
//! | a waiter looks again without a watch event | after a jittered poll interval (default 1 s) |
//! | a request that failed for a transient reason | sent again after 2.5–5 ms, the pause doubling up to 50–100 ms, within its step |
//! | a waiter's look at the queue that failed | tried again after 25–50 ms, the pause doubling up to the poll interval, until the wait ends |
//!
//! # Failures of the cluster
//!
//! Grants, writes and linearizable reads need a quorum (a majority of members and a
//! leader). When the leader dies, a new one is elected within about an election
//! timeout; the new leader extends every lease by that long, so no key expires for
//! want of a leader, and the holders' keep-alives get through again once it is elected.
//! A holder cut off from the quorum (a partitioned member, a majority down) cannot
//! renew; it is told at its local deadline, before etcd (whose TTL counts later) frees
//! its key. A member restarted rejoins with its data; the client sends requests to the
//! members that answer. Waiters keep their places through all this (see
//! [Transient failures](self#transient-failures)).
//!
//! A leader that stalls (a long pause, a slow disk, CPU starvation) while the others
//! elect a successor can, in etcd before 3.4.31, 3.5.13 and 3.6.0, revoke as it resumes
//! the leases it saw expire while it stood still, although its successor kept them
//! alive: a holder's key is deleted and the next waiter is granted at once. The holder
//! is told as soon as its watch sees the deletion (within a few milliseconds on a
//! loopback cluster), normally before the waiter, which must read the queue again
//! first; but both watches see the same deletion, so that order is not guaranteed.
//! [`build`](EtcdBackendBuilder::build) names such a server in a warning, with its
//! version; [`refuse_stale_leader_revocation`](EtcdBackendBuilder::refuse_stale_leader_revocation)
//! refuses it.
//!
//! # What this backend does not guarantee
//!
//! - **Clock rate.** Validity is a duration measured on two clocks (this process's and
//!   the etcd leader's); the drift margin must cover how much faster this clock can run
//!   than the leader's over one lease. Wall clocks are never compared.
//! - **A stalled holder.** A holder whose process pauses past its lease loses the key
//!   to the next waiter; it learns it from [`LeaseSignal::is_lost`](crate::LeaseSignal::is_lost)
//!   at its next look (by the clock alone), not before. Use the fencing token where a
//!   late write must be refused.
//! - **Restores and data loss.** Fencing tokens are etcd revisions. A cluster restored
//!   from a snapshot (`etcdctl snapshot restore`), or one that lost acknowledged writes
//!   (every member restarted after running with unsafe no-fsync settings), starts again
//!   from an older revision and can issue tokens issued before. Restoring also brings
//!   back the contender keys of that moment, whose leases are gone: they are deleted
//!   when etcd expires those leases.
//! - **Keys deleted by hand.** An operator's `etcdctl del` of a holder's key (or
//!   `etcdctl lease revoke` of its lease) grants the lock to the next waiter at once;
//!   the holder learns it from its watch on its key at the same time, normally first
//!   (the waiter reads the queue again before it holds), but not by a guarantee. Keep
//!   the prefix away from other writers (etcd's role-based access control can).
//! - **Shared holders and permits.** The reader/writer and n-permit recipes fit this
//!   queue (a reader waits only for older writers; a permit holder for the n-th older
//!   key), but are not built yet: one holder per key.
//!
//! # Unsafe setups refused
//!
//! [`build`](EtcdBackendBuilder::build) connects to every endpoint and refuses, with a
//! [`SetupError`] that names the problem:
//!
//! - endpoints that belong to different etcd clusters (two cluster ids): each cluster
//!   would grant the same key;
//! - a drift margin of half the lease or more (no validity would be left);
//! - with [`refuse_stale_leader_revocation`](EtcdBackendBuilder::refuse_stale_leader_revocation),
//!   a member whose etcd lets a stale leader revoke live leases (see
//!   [Failures of the cluster](self#failures-of-the-cluster)); without it, such a
//!   member is named in a warning.
//!
//! An endpoint that does not answer within the command timeout is named in a warning;
//! if none answers, [`SetupError::Failed`] names each one (without credentials) with
//! why, as in `etcd lock backend setup failed: at http://etcd-0:2379: Unavailable: tcp
//! connect error: Connection refused (os error 111)`.
//!
//! etcd decides the rest itself: the quorum, linearizable reads (this backend never
//! asks for serializable ones), and a shortest lease (a longer TTL than asked only
//! delays the takeover of a crashed holder's key, never the holder's own deadline).

// One concern per file: `keys` names the etcd keys, `lease` queues, waits, renews and
// gives back (etcd's steps of the `backend::ttl` engine), `failure` says which
// failures are tried again and runs one step, `holder` reads the oldest key of a
// queue, `setup` checks the endpoints when the backend is built. This file has the
// public types and their configuration.
mod deployment;
mod failure;
mod holder;
mod keys;
mod lease;
mod setup;
mod spares;
mod watches;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use self::keys::{with_slash, LockKeys};
use super::settings::{self, Defaults, Settings};
use super::SetupError;
use super::{Acquisition, BoxFuture, Holder, LockBackend};
use crate::error::LockError;
use crate::key::Key;

pub use self::failure::EtcdLockError;

/// The default [`EtcdBackendBuilder::lease`].
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default [`EtcdBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);
/// The default [`EtcdBackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// The default [`EtcdBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "keyed-lock/";
/// The shortest lease accepted: etcd counts leases in whole seconds.
pub const MIN_LEASE: Duration = Duration::from_secs(1);

/// A [`LockBackend`] on an etcd cluster (v3 API, etcd 3.4 or newer): one client,
/// shared by every clone. See the [module docs](self).
///
/// ```no_run
/// use tower_keyed_lock::backend::etcd::EtcdBackend;
/// use tower_keyed_lock::KeyedLockLayer;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = EtcdBackend::connect(["http://127.0.0.1:2379"]).await?;
/// let layer = KeyedLockLayer::by_header("idempotency-key")
///     .name("deliveries")
///     .backend(backend);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

/// Configures an [`EtcdBackend`]; made by [`EtcdBackend::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::etcd::EtcdBackend;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = EtcdBackend::builder(["http://127.0.0.1:2379"])
///     .lease(Duration::from_secs(10))
///     .command_timeout(Duration::from_millis(500))
///     .prefix("billing/locks/")
///     .build()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdBackendBuilder {
    endpoints: Vec<String>,
    options: ConnectOptions,
    config: Settings,
    refuse_stale_leader: bool,
}

/// etcd's defaults and limits.
static DEFAULTS: Defaults = settings::defaults!(setup::ENGINE, |prefix| Ok(with_slash(prefix)));

/// What every clone of a backend shares.
struct Inner {
    client: Client,
    config: Settings,
    /// The TTL asked of etcd, in whole seconds.
    ttl: i64,
    /// The holders' own keys, watched for their deletion.
    watches: watches::Watches,
    /// Leases granted ahead of the acquisitions that take them.
    spares: spares::Spares,
}

impl EtcdBackend {
    /// A builder for a backend on the cluster at `endpoints` (`http://host:port`;
    /// several members' URLs let the client go on when one is down).
    pub fn builder<E: Into<String>>(endpoints: impl IntoIterator<Item = E>) -> EtcdBackendBuilder {
        EtcdBackendBuilder {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            options: ConnectOptions::new(),
            refuse_stale_leader: false,
            config: Settings::new(&DEFAULTS),
        }
    }

    /// A backend with the defaults, on the cluster at `endpoints`.
    pub async fn connect<E: Into<String>>(
        endpoints: impl IntoIterator<Item = E>,
    ) -> Result<Self, SetupError> {
        Self::builder(endpoints).build().await
    }

    /// The prefix of the queue of `key` for the layer called `name` (see
    /// [etcd keys](self#etcd-keys)): every contender's key is this and a lease id.
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::etcd::EtcdBackend;
    /// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
    /// # let backend = EtcdBackend::connect(["http://127.0.0.1:2379"]).await?;
    /// assert_eq!(backend.queue_prefix("orders", "42"), "keyed-lock/orders/42/");
    /// assert_eq!(backend.queue_prefix("orders", "a/b"), "keyed-lock/orders/a%2Fb/");
    /// # Ok(())
    /// # }
    /// ```
    pub fn queue_prefix(&self, name: &str, key: &str) -> String {
        LockKeys::new(&self.inner.config.prefix, name, key).queue
    }

    /// The client the backend uses (cheap to clone), for the application's own calls.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for EtcdBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let endpoints: Vec<String> = self
            .endpoints
            .iter()
            .map(|endpoint| setup::without_credentials(endpoint))
            .collect();
        f.debug_struct("EtcdBackendBuilder")
            .field("endpoints", &endpoints)
            .field("refuse_stale_leader_revocation", &self.refuse_stale_leader)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl EtcdBackendBuilder {
    settings::lease_settings!(config; instance_id lease renewal drift_margin command_timeout poll_interval prefix);

    /// The client's connection options (user and password, TLS with the client's TLS
    /// features); the backend adds its own timeouts and HTTP/2 keep-alive to them.
    pub fn connect_options(mut self, options: ConnectOptions) -> Self {
        self.options = options;
        self
    }

    /// Whether [`build`](Self::build) refuses an etcd server that lets a leader that
    /// stalled and resumed revoke leases its successor kept alive (etcd before 3.4.31,
    /// 3.5.13 and 3.6.0; see [Failures of the cluster](self#failures-of-the-cluster)).
    /// Default `false`: such a server is named in a warning.
    pub fn refuse_stale_leader_revocation(mut self, refuse: bool) -> Self {
        self.refuse_stale_leader = refuse;
        self
    }

    /// Connects, and checks the setup (see [Unsafe setups refused](self#unsafe-setups-refused)):
    /// every endpoint that answers within the command timeout must report the same
    /// cluster id, and at least one must answer; an error names every endpoint that
    /// did not (without credentials) and why.
    pub async fn build(self) -> Result<EtcdBackend, SetupError> {
        let Self {
            endpoints,
            options,
            config,
            refuse_stale_leader,
        } = self;
        let config = config.check()?;
        let limit = config.command_timeout;
        // etcd's gRPC server refuses pings more often than every 5 s (ENHANCE_YOUR_CALM
        // closes the connection), so HTTP/2 keep-alive is the slow backstop for a dead
        // connection; every request has its own timeout.
        let options = options
            .with_connect_timeout(limit)
            .with_keep_alive(Duration::from_secs(5), limit.max(Duration::from_secs(1)))
            .with_keep_alive_while_idle(false)
            .with_tcp_keepalive(Duration::from_secs(5))
            // A member without a leader fails requests at once instead of holding them.
            .with_require_leader(true);

        setup::check_endpoints(&endpoints, &options, limit, refuse_stale_leader).await?;
        let client = Client::connect(&endpoints, Some(options))
            .await
            .map_err(|error| {
                let shown: Vec<String> = endpoints
                    .iter()
                    .map(|endpoint| setup::without_credentials(endpoint))
                    .collect();
                SetupError::failed(setup::ENGINE, shown.join(", "), setup::chain(&error))
            })?;
        let ttl = i64::try_from(config.lease.as_millis().div_ceil(1000)).unwrap_or(i64::MAX);
        Ok(EtcdBackend {
            inner: Arc::new(Inner {
                watches: watches::Watches::new(client.clone(), config.command_timeout),
                spares: spares::Spares::default(),
                client,
                config,
                ttl,
            }),
        })
    }
}

impl LockBackend for EtcdBackend {
    super::engine_head::engine_head!("etcd", findings = deployment::findings);

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let keys = LockKeys::new(&self.inner.config.prefix, name, key.as_str());
        Box::pin(self.inner.clone().acquire(keys, wait))
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let keys = LockKeys::new(&self.inner.config.prefix, name, key.as_str());
        Box::pin(self.inner.clone().holder(keys))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::setup_error::assert_invalid;

    #[tokio::test]
    async fn a_drift_of_half_the_lease_is_refused_by_name() {
        let builder = EtcdBackend::builder(["http://127.0.0.1:1"])
            .lease(Duration::from_secs(2))
            .drift_margin(Duration::from_secs(1));
        assert_invalid(builder.build().await, "drift margin");
    }

    #[test]
    fn the_prefix_gets_a_slash() {
        let builder = EtcdBackend::builder(["http://127.0.0.1:2379"]);
        let prefix = |builder: EtcdBackendBuilder| builder.config.check().unwrap().prefix;
        assert_eq!(prefix(builder.clone().prefix("app")), "app/");
        assert_eq!(prefix(builder.prefix("app/")), "app/");
    }
}
