//! Redis backend: serializes a key across every instance that shares a Redis server.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::backend::redis::RedisBackend;
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! # async fn pay() {}
//! # async fn app() -> Result<Router, redis::RedisError> {
//! let backend = RedisBackend::builder(redis::Client::open("redis://127.0.0.1/")?)
//!     .lease(Duration::from_secs(10))
//!     .build()
//!     .await?;
//! let app = Router::new().route("/orders/{order_id}/pay", post(pay)).layer(
//!     KeyedLockLayer::by_path("order_id")
//!         .name("orders")
//!         .wait_timeout(Duration::from_secs(2))
//!         .backend(backend),
//! );
//! # Ok(app)
//! # }
//! ```
//!
//! # How a key is held
//!
//! - **Acquire.** One Lua script runs `SET lock token NX PX lease` with a fresh random
//!   128-bit token and, when granted, `INCR`s the key's fence counter: the fencing token
//!   ([`LockInfo::fencing_token`](crate::LockInfo::fencing_token)). When the key is held
//!   it returns the holder's remaining TTL instead. An attempt whose answer never comes
//!   (error, timeout, or the acquire future dropped) may still have been granted, so its
//!   token is released in the background: the acquire is cancel-safe by itself.
//! - **Wait.** Each backend keeps one pub/sub subscription to a release channel. A
//!   waiter retries when a release of its key is announced there, or else after a
//!   jittered [`poll_interval`](RedisBackendBuilder::poll_interval) capped by the
//!   holder's remaining TTL, until the request's wait is over. A lost message only costs
//!   latency: the poll finds the key free.
//! - **Validity.** The lease counts as valid until *send time of the last successful
//!   acquire or renewal + lease − drift margin*, on the monotonic clock. At that instant
//!   it is declared lost (even if Redis never answers again), as it is at the first
//!   reply saying the key is no longer ours; the handler sees it through
//!   [`LockInfo::lease`](crate::LockInfo::lease).
//! - **Renewal.** While held, a task renews every lease/3 with a compare-and-`PEXPIRE`
//!   script, and stops when the lease is released, dropped or lost, or at
//!   [`max_hold`](RedisBackendBuilder::max_hold).
//! - **Release.** A compare-and-delete script that also `PUBLISH`es the release when a
//!   waiter marked the key (a failed acquire leaves the mark; an uncontended release
//!   publishes nothing). If Redis cannot be reached within the command timeout, the
//!   release is retried in the background, and at worst the key expires by its lease.
//!
//! Every command is bounded by [`command_timeout`](RedisBackendBuilder::command_timeout):
//! when Redis is down or silent, acquisitions fail with
//! [`LockError::Backend`] promptly and the layer answers 503 (or runs the
//! request under its local lock with [`fail_open`](crate::KeyedLockLayer::fail_open)).
//! Commands go through a [`ConnectionManager`], which reconnects by itself; the
//! subscription resubscribes after a reconnect.
//!
//! # Fairness between instances
//!
//! Within an instance, waiters of a key queue in arrival order on the layer's local lock
//! and only the first contends in Redis. Between instances there is no queue: a release
//! wakes the one contender of each waiting instance, and the first `SET NX` to reach
//! Redis wins. The releasing instance's next local waiter contends too, from the moment
//! the release is acknowledged (about when the others get the release message), so
//! under constant contention one instance can win several times in a row; nobody
//! starves for longer than the others keep the key busy. For arrival order across
//! instances, use the PostgreSQL backend.
//!
//! # Redis keys
//!
//! A layer named `name` locks request key `key` under
//!
//! ```text
//! {<prefix><name>:<key>}:lock     the token of the holder, with the lease as TTL
//! {<prefix><name>:<key>}:fence    the fence counter (no TTL unless `fence_ttl` is set)
//! {<prefix><name>:<key>}:waiting  while another instance waits: its release publishes
//! ```
//!
//! `name` and `key` are each written as-is when they are at most 64 bytes of ASCII
//! letters, digits and `- _ . @ + = / ~ ,`; anything else (`:`, `{`, `}`, `*`,
//! whitespace, other bytes, empty or longer text) is written as `#` followed by the
//! lowercase hex SHA-256 of its UTF-8 bytes. The plain alphabet has neither `#` nor
//! `:`, so a plain form never equals a hashed one, and the part between the braces splits
//! back into prefix, name and key at its last two colons: distinct (prefix, name, key)
//! triples never share a Redis key. The prefix (default `"keyed-lock:"`) gets a trailing
//! `:` if it has none and may not contain braces. The braces are a Redis Cluster hash
//! tag: the keys of a lock live in one slot, as a script needs.
//! [`RedisBackend::lock_key`] computes the name of the lock key.
//!
//! The release channel is `<prefix>release`; its messages carry the lock key.
//!
//! The subscription uses RESP3 (Redis 6 or newer), whatever protocol the commands use.

// One concern per file: `keys` names the Redis keys, `scripts` holds the Lua run on
// Redis, `lease` acquires, renews and gives back leases, and `subscriber` turns release
// messages into wake-ups. This file has the public types and their configuration.
mod keys;
mod lease;
mod scripts;
mod subscriber;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, ErrorKind, RedisError, Script};
use tokio::sync::{oneshot, watch};
use tokio::time::timeout;

use self::keys::RedisKeys;
use self::scripts::{ACQUIRE, RELEASE, RENEW};
use self::subscriber::{Releases, Subscriber};
use super::{BoxFuture, Lease, LockBackend};
use crate::key::Key;
use crate::locks::LockError;

/// The default [`RedisBackendBuilder::lease`].
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default [`RedisBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);
/// The default [`RedisBackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// The default [`RedisBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "keyed-lock:";
/// The shortest lease accepted: renewal runs every lease/3.
pub const MIN_LEASE: Duration = Duration::from_millis(10);

/// Backoff of resubscription, and of a release retried in the background.
const RESUBSCRIBE_MIN: Duration = Duration::from_millis(50);
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(1);

/// A [`LockBackend`] on Redis: one connection for commands, one subscription for
/// release messages, shared by every clone. See the [module docs](self).
///
/// ```no_run
/// use tower_keyed_lock::backend::redis::RedisBackend;
/// use tower_keyed_lock::KeyedLockLayer;
///
/// # async fn run() -> Result<(), redis::RedisError> {
/// let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
/// let layer = KeyedLockLayer::by_header("idempotency-key")
///     .name("deliveries")
///     .backend(backend);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

/// Configures a [`RedisBackend`]; made by [`RedisBackend::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::redis::RedisBackend;
///
/// # async fn run() -> Result<(), redis::RedisError> {
/// let backend = RedisBackend::builder(redis::Client::open("redis://127.0.0.1/")?)
///     .lease(Duration::from_secs(10))
///     .max_hold(Some(Duration::from_secs(60)))
///     .prefix("shop:locks:")
///     .command_timeout(Duration::from_millis(500))
///     .build()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct RedisBackendBuilder {
    client: Client,
    config: Config,
}

#[derive(Clone, Debug)]
struct Config {
    lease: Duration,
    renewal: bool,
    max_hold: Option<Duration>,
    /// Empty, or ends with `:`; no braces.
    prefix: String,
    /// `None`: 1% of the lease + 2 ms.
    drift: Option<Duration>,
    command_timeout: Duration,
    poll_interval: Duration,
    fence_ttl: Option<Duration>,
}

impl Config {
    fn drift(&self) -> Duration {
        self.drift
            .unwrap_or(self.lease / 100 + Duration::from_millis(2))
    }

    /// The TTL an acquisition asks for: the lease, shortened to `max_hold`.
    fn first_ttl(&self) -> Duration {
        self.max_hold.map_or(self.lease, |max| max.min(self.lease))
    }
}

struct Inner {
    commands: ConnectionManager,
    config: Config,
    drift: Duration,
    acquire: Script,
    renew: Script,
    release: Script,
    channel: String,
    releases: Arc<Releases>,
    subscribed: watch::Receiver<bool>,
    /// Dropped with the last user of the backend; that ends the subscription task.
    _stop: oneshot::Sender<()>,
}

impl RedisBackend {
    /// Starts configuring a backend that talks to Redis through `client`.
    pub fn builder(client: Client) -> RedisBackendBuilder {
        RedisBackendBuilder {
            client,
            config: Config {
                lease: DEFAULT_LEASE,
                renewal: true,
                max_hold: None,
                prefix: DEFAULT_PREFIX.to_owned(),
                drift: None,
                command_timeout: DEFAULT_COMMAND_TIMEOUT,
                poll_interval: DEFAULT_POLL_INTERVAL,
                fence_ttl: None,
            },
        }
    }

    /// A backend with the default settings on the Redis server at `url`
    /// (such as `redis://127.0.0.1/`); see [`RedisBackendBuilder::build`].
    ///
    /// ```no_run
    /// use tower_keyed_lock::backend::redis::RedisBackend;
    ///
    /// # async fn run() -> Result<(), redis::RedisError> {
    /// let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
    /// # let _ = backend;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Self::builder(Client::open(url)?).build().await
    }

    /// The Redis key that holds the lock of `key` for the layer called `name` (see
    /// [Redis keys](self#redis-keys)); its fence counter and waiting mark have the same
    /// name with `:fence` and `:waiting` instead of `:lock`.
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::redis::RedisBackend;
    /// # async fn run() -> Result<(), redis::RedisError> {
    /// # let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
    /// assert_eq!(backend.lock_key("orders", "42"), "{keyed-lock:orders:42}:lock");
    /// assert!(backend.lock_key("orders", "a:b").starts_with("{keyed-lock:orders:#"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn lock_key(&self, name: &str, key: &str) -> String {
        RedisKeys::new(&self.inner.config.prefix, name, key)
            .lock
            .to_string()
    }

    /// Whether the release subscription is up now. While it is down, waiters poll every
    /// 50 ms at most instead of waiting for release messages.
    pub fn is_subscribed(&self) -> bool {
        *self.inner.subscribed.borrow()
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("config", &self.inner.config)
            .field("subscribed", &self.is_subscribed())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RedisBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackendBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedisBackendBuilder {
    /// How long a grant lasts in Redis without renewal (default [`DEFAULT_LEASE`],
    /// 30 s). It bounds how long a crashed instance keeps a key; with renewal on, a
    /// live holder keeps it as long as it runs.
    ///
    /// # Panics
    /// If `lease` is shorter than [`MIN_LEASE`] (10 ms).
    pub fn lease(mut self, lease: Duration) -> Self {
        assert!(
            lease >= MIN_LEASE,
            "RedisBackend lease must be at least {MIN_LEASE:?}"
        );
        self.config.lease = lease;
        self
    }

    /// Whether a held lease is renewed every lease/3 (default on). Off, a request that
    /// runs longer than the lease loses it.
    pub fn renewal(mut self, renewal: bool) -> Self {
        self.config.renewal = renewal;
        self
    }

    /// The longest a lease lasts however often it is renewed (default `None`: no
    /// limit): the key expires in Redis, and the lease is lost, `max_hold` after the
    /// acquisition was sent. A stuck handler cannot hold a key forever.
    pub fn max_hold(mut self, max_hold: Option<Duration>) -> Self {
        self.config.max_hold = max_hold;
        self
    }

    /// The start of every Redis key and of the release channel (default
    /// [`DEFAULT_PREFIX`], `"keyed-lock:"`); a `:` is appended if it does not end with
    /// one. Applications that share a Redis keep apart by prefix.
    ///
    /// # Panics
    /// If `prefix` contains `{` or `}`, which would break the Redis Cluster hash tag.
    pub fn prefix(mut self, prefix: &str) -> Self {
        assert!(
            !prefix.contains(['{', '}']),
            "RedisBackend prefix must not contain braces: {prefix:?}"
        );
        let mut prefix = prefix.to_owned();
        if !prefix.is_empty() && !prefix.ends_with(':') {
            prefix.push(':');
        }
        self.config.prefix = prefix;
        self
    }

    /// What is taken off every validity period for clock drift between this process
    /// and Redis (default 1% of the lease + 2 ms): a lease counts as valid until
    /// send time + lease − drift margin.
    pub fn drift_margin(mut self, margin: Duration) -> Self {
        self.config.drift = Some(margin);
        self
    }

    /// The longest any Redis command may take (default [`DEFAULT_COMMAND_TIMEOUT`],
    /// 1 s). Past it the acquisition fails with [`LockError::Backend`], and a release
    /// returns and goes on retrying in the background (at worst the key expires by its
    /// lease). Also used as the connect timeout.
    ///
    /// A retry inside a request's wait is also cut short at the end of the wait; only
    /// the first attempt may outlast a wait shorter than one command.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.config.command_timeout = timeout;
        self
    }

    /// How long a waiter sleeps between attempts when no release message wakes it
    /// (default [`DEFAULT_POLL_INTERVAL`], 1 s): a random time between half of it and
    /// all of it, cut to the holder's remaining TTL and to the end of the wait. Release
    /// messages are the fast path; this only bounds the cost of a lost one.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.config.poll_interval = interval.max(Duration::from_millis(1));
        self
    }

    /// Lets a key's fence counter expire after it was last granted for this long
    /// (default `None`: counters stay forever, one small Redis key per key ever
    /// locked). Set it when keys come from clients (idempotency keys). A counter that
    /// expired starts again from the Redis server clock in microseconds, so tokens
    /// still increase as long as that clock does not step back. Kept at least as long
    /// as the lease.
    pub fn fence_ttl(mut self, ttl: Option<Duration>) -> Self {
        self.config.fence_ttl = ttl;
        self
    }

    /// Connects: checks that Redis answers and subscribes to the release channel, each
    /// within the command timeout, then starts the subscription task (on the current
    /// tokio runtime; it ends with the last clone of the backend and its leases). Fails
    /// if Redis cannot be reached or the subscription fails (it needs RESP3: Redis 6 or
    /// newer).
    ///
    /// # Panics
    /// If the drift margin is not shorter than half the lease.
    pub async fn build(self) -> Result<RedisBackend, RedisError> {
        let Self { client, config } = self;
        let drift = config.drift();
        assert!(
            drift < config.lease / 2,
            "RedisBackend drift margin {drift:?} must be shorter than half the lease {:?}",
            config.lease
        );
        let limit = config.command_timeout;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(limit))
            .set_response_timeout(Some(limit))
            // Few, short retries: a failed reconnection ends quickly and the next
            // command starts a new one, so the backend recovers soon after Redis does.
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(500));
        let mut commands = ConnectionManager::new_lazy_with_config(client.clone(), manager_config)?;
        let ping = redis::cmd("PING");
        timeout(limit, ping.query_async::<()>(&mut commands))
            .await
            .map_err(|_| timed_out("connecting to Redis"))??;

        let channel = format!("{}release", config.prefix);
        let subscriber = Subscriber::new(&client, channel.clone(), limit)?;
        let first = timeout(limit, subscriber.subscribe())
            .await
            .map_err(|_| timed_out("subscribing to the release channel"))??;
        let releases = Arc::new(Releases::default());
        let (subscribed_tx, subscribed) = watch::channel(true);
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(subscriber.run(first, releases.clone(), subscribed_tx, stopped));

        Ok(RedisBackend {
            inner: Arc::new(Inner {
                commands,
                config,
                drift,
                acquire: Script::new(ACQUIRE),
                renew: Script::new(RENEW),
                release: Script::new(RELEASE),
                channel,
                releases,
                subscribed,
                _stop: stop,
            }),
        })
    }
}

fn timed_out(what: &'static str) -> RedisError {
    RedisError::from((ErrorKind::Io, "timed out", what.to_owned()))
}

impl LockBackend for RedisBackend {
    fn acquire(
        &self,
        name: &'static str,
        key: &Key,
        wait: Duration,
    ) -> BoxFuture<Result<Lease, LockError>> {
        let keys = RedisKeys::new(&self.inner.config.prefix, name, key.as_str());
        Box::pin(self.inner.clone().acquire(Arc::new(keys), wait))
    }
}

/// A random duration between half of `max` and `max`, so that instances woken by
/// the same event do not retry in lockstep.
fn jitter(max: Duration) -> Duration {
    let half = max / 2;
    let spread = u64::try_from((max - half).as_micros()).unwrap_or(u64::MAX);
    let random = getrandom::u64().unwrap_or(0);
    half + Duration::from_micros(random % spread.saturating_add(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_gets_a_colon_and_refuses_braces() {
        let builder = RedisBackend::builder(Client::open("redis://127.0.0.1/").unwrap());
        assert_eq!(builder.clone().prefix("app").config.prefix, "app:");
        assert_eq!(builder.clone().prefix("app:").config.prefix, "app:");
        assert_eq!(builder.clone().prefix("").config.prefix, "");
        let braces = std::panic::catch_unwind(|| builder.prefix("a{b}"));
        assert!(braces.is_err());
    }

    #[test]
    fn drift_defaults_to_one_percent_plus_two_ms() {
        let builder = RedisBackend::builder(Client::open("redis://127.0.0.1/").unwrap())
            .lease(Duration::from_secs(10));
        assert_eq!(builder.config.drift(), Duration::from_millis(102));
        let builder = builder.drift_margin(Duration::from_millis(7));
        assert_eq!(builder.config.drift(), Duration::from_millis(7));
    }

    #[test]
    fn jitter_stays_between_half_and_all() {
        for _ in 0..100 {
            let d = jitter(Duration::from_millis(100));
            assert!(d >= Duration::from_millis(50) && d <= Duration::from_millis(100));
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }
}
