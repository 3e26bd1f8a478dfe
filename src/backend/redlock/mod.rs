//! Redlock backend: serializes a key across every instance through N independent Redis
//! masters (antirez's Redlock), so that no single Redis is a point of failure: the lock
//! stays available, and exclusive, while a majority of the masters answers.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_keyed_lock::backend::{redlock::RedlockBackend, SetupError};
//! use tower_keyed_lock::{DistributedLocks, KeyedLockLayer};
//!
//! # async fn run() -> Result<(), SetupError> {
//! let masters = [
//!     "redis://10.0.0.1:6379/",
//!     "redis://10.0.0.2:6379/",
//!     "redis://10.0.0.3:6379/",
//!     "redis://10.0.0.4:6379/",
//!     "redis://10.0.0.5:6379/",
//! ];
//! let backend = RedlockBackend::builder(masters)
//!     .lease(Duration::from_secs(10))
//!     .build()
//!     .await?;
//! let layer = KeyedLockLayer::by_header("idempotency-key")
//!     .name("orders")
//!     .wait_timeout(Duration::from_secs(2))
//!     .backend(backend.clone());
//! let jobs = DistributedLocks::builder("jobs").backend(backend).build();
//! if let Ok(guard) = jobs.try_lock("nightly-report").await {
//!     // Only this instance runs it, as long as `guard.is_lost()` says false.
//!     guard.release().await;
//! }
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! The client is the [`redis`] crate, the one the Redis backend uses (its connection
//! manager, its script support and TCP settings): Redlock is a protocol on plain Redis
//! masters, so every piece of that backend that does not depend on one server is
//! reused here: key naming, the compare-and-`PEXPIRE` renewal, the connection replaced
//! when it goes silent, the eviction check and the restart guard.
//!
//! # How a key is held
//!
//! - **Acquire.** An attempt takes a fresh random 128-bit token, notes the time, and
//!   sends `SET lock token NX PX lease` (as a script, with the two refusals below) to
//!   every master at once, each bounded by the
//!   [`command_timeout`](RedlockBackendBuilder::command_timeout), which must be small
//!   against the lease. It is granted when a majority (⌊N/2⌋ + 1) answered "granted"
//!   *and* the validity budget is not spent: *lease − time since the attempt was sent
//!   − drift margin* is still positive. It does not wait for the rest once a majority
//!   granted; a failed attempt waits for every answer (at most the command timeout),
//!   to know what to give back, and whether the key is busy or a majority unreachable.
//! - **Partial grants.** An attempt that got no majority (or got it too late) is given
//!   back on every master, those that did not answer included (a silent master may
//!   still run it): a compare-and-delete, retried in the background until every master
//!   answered it (a master that refuses connections is down: the attempt never reached
//!   it, and it is not retried). A master where the token did not hold the key keeps a
//!   mark, and refuses a late attempt of that token, for as long as the network can
//!   still deliver one: ten command timeouts, at least 5 s (when the masters'
//!   connections give up on unacknowledged data), within one lease and ten. A late
//!   attempt breaks no exclusion (nobody counts its vote); it would cost that master's
//!   vote for a lease.
//! - **Wait.** By polling: the next attempt follows a jittered pause that doubles from
//!   5 ms up to the [`poll_interval`](RedlockBackendBuilder::poll_interval) (default
//!   200 ms), cut to the shortest time a master said the holder's key has left, and to
//!   the end of the request's wait. There is no pub/sub across N masters: a hand-off
//!   costs up to one poll interval.
//! - **Split votes.** Contenders that reach a free key at once can split the masters
//!   between them so that none has a majority; each gives its partial grant back and
//!   tries again after a random pause of at most 10 ms, even past the end of a short
//!   wait, until one command timeout after the acquisition started. So a try-once
//!   acquisition (`try_lock`) of a free key rarely fails for want of a majority, and
//!   no acquisition outlives its wait by more than one command timeout.
//! - **Validity.** The lease counts as valid until *send time of the last attempt or
//!   renewal that a majority granted + lease − drift margin*, on the monotonic clock. At
//!   that instant it is declared lost (even if no master answers again), as it is when
//!   more than a minority of the masters say the key is not the token's any more.
//! - **Renewal.** While held, every lease/3, the compare-and-`PEXPIRE` script goes to
//!   every master; only a renewal that a majority extended before the current deadline
//!   moves it. A renewal that reached fewer leaves the deadline as it was, and is
//!   retried every lease/12.
//! - **Release.** Compare-and-delete on every master, retried in the background for
//!   masters that did not answer (not for masters that are down, refusing connections);
//!   at worst the key expires by its lease.
//! - **Cancel safety.** Each attempt's token is guarded from before it is sent: an
//!   acquisition dropped at any await (or ended by an error) gives back, on every
//!   master, whatever that attempt may have been granted, in a task of its own.
//!
//! # Timing rules
//!
//! | what | when |
//! |---|---|
//! | an attempt is granted | a majority granted, and less than *lease − drift* passed since it was sent |
//! | one command on one master | at most the command timeout (default 100 ms); the lease must be at least 3 command timeouts |
//! | renewal | every lease/3; retried every lease/12 while no majority answers |
//! | a holder counts its lease lost | send time of the last majority grant or renewal + lease − drift margin (default 1% of the lease + 2 ms), or at the first majority of "not ours" |
//! | the masters free a stopped holder's key | one lease after each master last extended it |
//!
//! # Failures of the masters
//!
//! - **A minority down or silent** (2 of 5): the lock stays exclusive and available.
//!   Grants and renewals are decided by the majority that answers, without waiting for
//!   the rest. A failed attempt (a busy key) waits for the silent ones up to the
//!   command timeout, so polling slows by that much; what a silent master may have
//!   granted is given back there until it answers (for as long as its mark lasts).
//!   A master that is down (refuses connections) costs nothing: nothing reached it.
//! - **A majority down** (3 of 5): no attempt can be granted; acquisitions fail with
//!   [`LockError::Backend`] as soon as a majority refused (the layer answers 503), and
//!   holders are told their lease is lost at their deadline. A majority *silent* for a
//!   command timeout is tried again within the wait (the wait bounds the waiting),
//!   then fails the same way, naming the masters that did not answer.
//! - **A master restarted empty** (no persistence, or a snapshot older than the grant)
//!   forgets the keys it held, and its vote could complete a second majority while a
//!   holder still counts on the first. The **restart guard** (on by default; antirez's
//!   "delayed restarts") makes a master whose uptime is below the lease plus a second
//!   vote for nobody: by then every lease it may have counted in has run out (a
//!   renewal counts only masters that still hold the key, so a master that lost it is
//!   in no majority a holder counts on afterwards). It reads
//!   `uptime_in_seconds`; every instance must use the same lease. If restarted masters
//!   are what keeps a majority out of reach, an acquisition waits them out, or fails
//!   with a [`RetryLater`](crate::backend::RetryLater) (503 with `Retry-After`).
//! - **Eviction.** [`build`](RedlockBackendBuilder::build) refuses a master whose
//!   `maxmemory-policy` is not `noeviction`, as the Redis backend does.
//!
//! # Redis keys
//!
//! The same as the Redis backend's ([Redis keys](super::redis#redis-keys)): a layer
//! named `name` locks request key `key` under `{<prefix><name>:<key>}:lock` on every
//! master (name and key written as-is when short and plain, else as `#` + hex SHA-256:
//! any UTF-8 key, bounded length, no injection), and the give-back mark under
//! `{<prefix><name>:<key>}:lock:given-back:<token>`. No fencing token is kept and
//! there is no waiting mark. [`RedlockBackend::lock_key`] computes the lock key.
//!
//! # Who holds a key
//!
//! The script that grants a key on a master also writes `{<prefix><name>:<key>}:holder`
//! there: the token, the master's time in ms and the instance id
//! ([`instance_id`](RedlockBackendBuilder::instance_id)); a release deletes it, every
//! renewal extends it with the lock, and it expires one lease after the lock (a
//! crashed holder's). So a master keeps records only for keys held now, and for at
//! most a lease after a crashed holder's lock expired; a given-back mark, left when a
//! release finds the key not its own, stays as long as the network could deliver a
//! late attempt (ten command timeouts, at least 5 s, within one lease and ten). A
//! released key leaves nothing after the longer of the two. [`holder`](LockBackend::holder) asks
//! every master and names the token that a majority has (`None` if none has; a
//! [`LockError::Backend`] if fewer than a majority answered); `lease_left` is the least
//! PTTL among them. No fencing token: Redlock issues none.
//!
//! # What this backend does not guarantee
//!
//! - **Fencing tokens: none, and none can be had.** A fencing token must grow strictly
//!   from holder to holder. The masters share no counter: each could count its own
//!   grants, but two majorities need share only one master, which may be the one that
//!   restarted and counts from scratch, so no number read from them is sure to grow
//!   (Martin Kleppmann's analysis, "How to do distributed locking", 2016: Redlock
//!   produces no number that grows with every grant, and a counter that must never go
//!   back needs consensus, which Redlock does not run). So
//!   [`Lease::fencing_token`](crate::Lease::fencing_token) and
//!   [`LockInfo::fencing_token`](crate::LockInfo::fencing_token) are `None`,
//!   [`issues_fencing_tokens`](crate::LockBackend::issues_fencing_tokens) is `false`,
//!   and every configuration that needs them is refused with this reason: a replay
//!   store whose writes are fenced (`KeyedLockLayer::replay` panics; layers stacked by
//!   hand answer 500), and [`fencing(true)`](RedlockBackendBuilder::fencing). Where a
//!   late write must be refused, use a backend that issues tokens (PostgreSQL with
//!   `fencing(true)`, etcd).
//! - **Timing assumptions.** Safety rests on bounded clock drift (the drift margin must
//!   cover how much faster this process's clock can run than each master's over one
//!   lease) and on the restart guard. A master's clock that jumps forward (a wall-clock
//!   step: Redis expires keys by wall time) expires a key early, and its vote may then
//!   complete a second majority: run the masters with a slewing NTP, never stepped.
//! - **A stalled holder.** A holder whose process pauses past its lease loses the key
//!   to the next waiter; it learns it from [`LeaseSignal::is_lost`](crate::LeaseSignal::is_lost)
//!   at its next look (by the clock alone), not before, and nothing fences its late
//!   writes.
//! - **Fairness.** Between instances there is no queue: the first attempt to reach a
//!   majority after a release wins. Within an instance, waiters queue on the layer's
//!   local lock as with every backend.
//! - **Operators.** A `FLUSHALL` or a `DEL` of a lock key on a majority, like a majority
//!   restarted with the guard off, frees a held key.

mod holder;
mod lease;
mod master;
mod quorum;
mod scripts;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::{Client, RedisError};

use self::master::Master;
use super::settings::{self, Defaults, Settings};
use super::{ttl, Acquisition, BoxFuture, Holder, LockBackend};
use super::{ServerFailure, SetupError};
use crate::backend::redis::key_prefix;
use crate::backend::redis::keys::RedisKeys;
use crate::error::LockError;
use crate::key::Key;

/// The default [`RedlockBackendBuilder::lease`].
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default [`RedlockBackendBuilder::command_timeout`]: small against the lease.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(100);
/// The default [`RedlockBackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(200);
/// The default [`RedlockBackendBuilder::prefix`] (the Redis backend's).
pub const DEFAULT_PREFIX: &str = "keyed-lock:";
/// The fewest masters accepted: with fewer, one master down leaves no majority.
pub const MIN_MASTERS: usize = 3;
/// The shortest lease accepted.
pub const MIN_LEASE: Duration = Duration::from_millis(30);

/// Why a [`RedlockBackend`] issues no fencing tokens; the error of every configuration
/// that needs them names it (see
/// [What this backend does not guarantee](self#what-this-backend-does-not-guarantee)).
pub const NO_FENCING_TOKENS: &str = "RedlockBackend cannot issue fencing tokens: its \
    Redis masters share no counter, and two majorities may share only a master that \
    restarted and counts from scratch, so no token could be guaranteed to grow from \
    holder to holder (Kleppmann, \"How to do distributed locking\"); use a backend that \
    issues them (PostgresBackend with fencing(true), EtcdBackend) where writes must be \
    fenced";

/// A [`LockBackend`] on N independent Redis masters (Redlock). Cheap to clone: clones
/// share the connections. See the [module docs](self).
#[derive(Clone)]
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

/// Configures a [`RedlockBackend`]; made by [`RedlockBackend::builder`].
#[derive(Clone)]
#[must_use]
pub struct RedlockBackendBuilder {
    urls: Vec<String>,
    config: Config,
}

#[derive(Clone, Debug)]
struct Config {
    settings: Settings,
    restart_guard: bool,
    allow_eviction: bool,
    fencing: bool,
}

/// Redlock's defaults and limits: a Redis backend's, with shorter command timeouts.
static DEFAULTS: Defaults = settings::defaults!("Redlock", key_prefix);

struct Inner {
    masters: Arc<[Master]>,
    config: Config,
    /// Leases held for less than a renewal period, with no task of their own.
    schedule: ttl::Schedule<Inner>,
}

impl RedlockBackend {
    /// Starts configuring a backend on these Redis masters (`redis://host:port/` URLs),
    /// at least [`MIN_MASTERS`], independent of each other (not replicas of one
    /// another); an odd number (3, 5, 7) gives the most failures tolerated per master.
    pub fn builder<U: Into<String>>(masters: impl IntoIterator<Item = U>) -> RedlockBackendBuilder {
        RedlockBackendBuilder {
            urls: masters.into_iter().map(Into::into).collect(),
            config: Config {
                settings: Settings::new(&DEFAULTS),
                restart_guard: true,
                allow_eviction: false,
                fencing: false,
            },
        }
    }

    /// The Redis key that holds the lock of `key` for the layer called `name` on every
    /// master (see [Redis keys](self#redis-keys)).
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::redlock::RedlockBackend;
    /// # async fn run(backend: RedlockBackend) {
    /// assert_eq!(backend.lock_key("orders", "42"), "{keyed-lock:orders:42}:lock");
    /// # }
    /// ```
    pub fn lock_key(&self, name: &str, key: &str) -> String {
        RedisKeys::new(&self.inner.config.settings.prefix, name, key)
            .lock
            .to_string()
    }

    /// The masters' `host:port`, in the order given.
    pub fn masters(&self) -> Vec<String> {
        self.inner
            .masters
            .iter()
            .map(|m| m.address.clone())
            .collect()
    }
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("masters", &self.masters())
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RedlockBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockBackendBuilder")
            .field("masters", &self.urls.len())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedlockBackendBuilder {
    settings::lease_settings!(config.settings; instance_id lease renewal drift_margin command_timeout poll_interval prefix);

    /// Whether a master up for less than a lease (plus one second) votes for nobody
    /// (default on). See [Failures of the masters](self#failures-of-the-masters).
    /// Off is for tests against masters that just started; **never in production**: a
    /// master restarted empty could then complete a second majority for a held key.
    pub fn restart_guard(mut self, on: bool) -> Self {
        self.config.restart_guard = on;
        self
    }

    /// Whether to build on masters that may evict keys — **unsafe** (default off:
    /// refused), as [`RedisBackendBuilder::allow_unsafe_eviction_policy`](
    /// crate::backend::redis::RedisBackendBuilder::allow_unsafe_eviction_policy).
    pub fn allow_unsafe_eviction_policy(mut self, allow: bool) -> Self {
        self.config.allow_eviction = allow;
        self
    }

    /// Asks for fencing tokens, which Redlock cannot give: `true` makes
    /// [`build`](Self::build) fail with [`SetupError::Unsafe`], naming the reason
    /// ([`NO_FENCING_TOKENS`]). The setting exists so that a configuration
    /// carried over from a backend that fences (`PostgresBackendBuilder::fencing(true)`) is
    /// refused, not silently unfenced.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.config.fencing = fencing;
        self
    }

    /// Checks the settings, connects to every master at once, and checks that a
    /// majority answers `PING` and that no master that answers may evict lock keys.
    /// Masters that do not answer yet are warned about and used when they do (their
    /// eviction policy unchecked).
    pub async fn build(self) -> Result<RedlockBackend, SetupError> {
        let Self { urls, config } = self;
        if config.fencing {
            return Err(SetupError::Unsafe(NO_FENCING_TOKENS.to_owned()));
        }
        if urls.len() < MIN_MASTERS {
            return Err(SetupError::Invalid(format!(
                "Redlock needs at least {MIN_MASTERS} independent Redis masters (5 is \
                 usual), {} given",
                urls.len()
            )));
        }
        let config = Config {
            settings: config.settings.check()?,
            ..config
        };
        let (lease, command_timeout) = (config.settings.lease, config.settings.command_timeout);
        if command_timeout * 3 > lease {
            return Err(SetupError::Invalid(format!(
                "the command timeout {command_timeout:?} must be at most a third of the \
                 lease {lease:?}"
            )));
        }
        let mut masters = Vec::with_capacity(urls.len());
        let mut addresses = Vec::with_capacity(urls.len());
        for url in &urls {
            let invalid = |error: RedisError| {
                SetupError::Invalid(format!("the Redis master URL {url:?}: {error}"))
            };
            let client = Client::open(url.as_str()).map_err(invalid)?;
            let address = client.get_connection_info().addr().clone();
            if addresses.contains(&address) {
                return Err(SetupError::Invalid(format!(
                    "Redis master {address} is listed twice: its vote would count twice"
                )));
            }
            addresses.push(address);
            let master = Master::new(&client, command_timeout)
                .map_err(|error| SetupError::failed(DEFAULTS.engine, url.clone(), error))?;
            masters.push(master);
        }
        let masters: Arc<[Master]> = masters.into();
        // Every master at once: a dead one costs one command timeout, not one each.
        let mut checks = tokio::task::JoinSet::new();
        for index in 0..masters.len() {
            let (masters, allowed) = (masters.clone(), config.allow_eviction);
            checks.spawn(async move {
                let master = &masters[index];
                if let Err(error) = master.ping().await {
                    return (index, Ok(Err(error)));
                }
                (index, master.check_eviction(allowed).await.map(Ok))
            });
        }
        let mut answered = 0;
        let mut failed = Vec::new();
        while let Some(check) = checks.join_next().await {
            let Ok((index, check)) = check else { continue };
            match check {
                Ok(Ok(())) => answered += 1,
                Ok(Err(error)) => {
                    tracing::warn!(
                        master = %masters[index].address,
                        %error,
                        "redlock master did not answer at start; used when it does"
                    );
                    failed.push(ServerFailure::new(masters[index].address.clone(), error));
                }
                Err(refusal) => {
                    let master = &masters[index].address;
                    return Err(SetupError::Unsafe(format!("master {master}: {refusal}")));
                }
            }
        }
        if answered < quorum::majority(masters.len()) {
            failed.sort_by(|a, b| a.server.cmp(&b.server));
            return Err(SetupError::Failed {
                engine: DEFAULTS.engine,
                failures: failed,
            });
        }
        Ok(RedlockBackend {
            inner: Arc::new(Inner {
                masters,
                config,
                // Nothing shows a hold gone before a renewal does.
                schedule: ttl::Schedule::new(Box::new(|| Box::pin(std::future::pending()))),
            }),
        })
    }
}

impl LockBackend for RedlockBackend {
    super::engine_head::engine_head!("redlock");

    /// Each master's eviction policy and clock, side by side.
    fn check_configuration(&self) -> BoxFuture<Vec<crate::backend::Finding>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let mut reads = tokio::task::JoinSet::new();
            for index in 0..inner.masters.len() {
                let inner = inner.clone();
                reads.spawn(async move { (index, inner.masters[index].findings().await) });
            }
            // In the masters' order, whichever answered first.
            let mut read = reads.join_all().await;
            read.sort_by_key(|(index, _)| *index);
            read.into_iter()
                .flat_map(|(_, findings)| findings)
                .collect()
        })
    }

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let keys = RedisKeys::new(&self.inner.config.settings.prefix, name, key.as_str());
        let inner = self.inner.clone();
        Box::pin(async move { ttl::acquire(&inner, &Arc::new(keys), wait).await })
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let keys = RedisKeys::new(&self.inner.config.settings.prefix, name, key.as_str());
        Box::pin(self.inner.clone().holder(Arc::new(keys)))
    }

    fn issues_fencing_tokens(&self) -> bool {
        false
    }

    fn no_fencing_tokens_reason(&self) -> Option<&'static str> {
        Some(NO_FENCING_TOKENS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three masters no test reaches: each refusal comes before any connection.
    fn three_masters() -> RedlockBackendBuilder {
        RedlockBackend::builder([
            "redis://127.0.0.1:1/",
            "redis://127.0.0.1:2/",
            "redis://127.0.0.1:3/",
        ])
    }

    /// What `build` refused `builder` with, which must name `reason`.
    async fn refusal(builder: RedlockBackendBuilder, reason: &str) -> SetupError {
        let error = builder.build().await.unwrap_err();
        assert!(error.to_string().contains(reason), "{error}");
        error
    }

    #[tokio::test]
    async fn too_few_masters_are_refused() {
        let two = RedlockBackend::builder(["redis://127.0.0.1:1/", "redis://127.0.0.1:2/"]);
        let error = refusal(two, "at least 3").await;
        assert!(matches!(error, SetupError::Invalid(_)), "{error}");
    }

    #[tokio::test]
    async fn a_master_listed_twice_is_refused() {
        let urls = [
            "redis://127.0.0.1:1/",
            "redis://127.0.0.1:2/",
            "redis://127.0.0.1:1/0",
        ];
        let error = refusal(RedlockBackend::builder(urls), "listed twice").await;
        assert!(matches!(error, SetupError::Invalid(_)), "{error}");
    }

    #[tokio::test]
    async fn fencing_is_refused_with_the_reason() {
        let fencing = three_masters().fencing(true);
        let error = refusal(fencing, "cannot issue fencing tokens").await;
        assert!(matches!(error, SetupError::Unsafe(_)), "{error}");
    }

    #[tokio::test]
    async fn a_command_timeout_long_against_the_lease_is_refused() {
        let slow = three_masters()
            .lease(Duration::from_millis(300))
            .command_timeout(Duration::from_millis(200));
        let error = refusal(slow, "a third of the lease").await;
        assert!(matches!(error, SetupError::Invalid(_)), "{error}");
    }
}
