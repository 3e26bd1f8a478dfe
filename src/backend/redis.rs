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

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, ErrorKind, PushInfo, PushKind, RedisError, Script};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::task::AbortHandle;
use tokio::time::{sleep, sleep_until, timeout, timeout_at, Instant};

use super::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LockBackend, ReleaseLease};
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

/// Names and keys longer than this are hashed.
const MAX_PLAIN_LEN: usize = 64;
/// How often a waiter polls while the subscription is down (capped by `poll_interval`).
const UNSUBSCRIBED_POLL: Duration = Duration::from_millis(50);
/// Backoff of resubscription, and of a release retried in the background.
const RESUBSCRIBE_MIN: Duration = Duration::from_millis(50);
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(1);
/// How often the subscription connection is pinged, to notice a silent server.
const KEEPALIVE: Duration = Duration::from_secs(5);

/// `KEYS[1]` lock, `KEYS[2]` fence, `KEYS[3]` waiting; `ARGV[1]` token, `ARGV[2]` lease
/// ms, `ARGV[3]` fence TTL ms (0: none), `ARGV[4]` waiting-mark TTL ms. Returns
/// `{1, fencing token}` or `{0, holder's PTTL}`.
///
/// A missing fence counter starts from the server clock in microseconds, so tokens keep
/// growing after the counter expired or Redis lost its data (as long as that clock does
/// not step back). The seed is concatenated as text: Lua numbers are doubles.
///
/// When not granted, the waiting mark tells the holder's release to publish. Its TTL
/// outlasts the caller's pause before the next attempt (which marks again), and is
/// only ever extended, so a waiter with a longer pause keeps its mark.
const ACQUIRE: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  if fence == 1 then
    local now = redis.call('TIME')
    redis.call('SET', KEYS[2], now[1] .. string.sub('00000' .. now[2], -6))
    fence = redis.call('INCR', KEYS[2])
  end
  if ARGV[3] ~= '0' then
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
  end
  return {1, fence}
end
if redis.call('PTTL', KEYS[3]) < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
end
return {0, redis.call('PTTL', KEYS[1])}
";

/// `KEYS[1]` lock; `ARGV[1]` token, `ARGV[2]` lease ms. 1 if still ours and extended.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// `KEYS[1]` lock, `KEYS[2]` waiting; `ARGV[1]` token, `ARGV[2]` release channel.
/// Deletes the lock only if it is still ours, and announces it if a waiter marked the
/// key (an uncontended release publishes nothing). 1 if deleted.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('DEL', KEYS[2]) == 1 then
    redis.call('PUBLISH', ARGV[2], KEYS[1])
  end
  return 1
end
return 0
";

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

/// A Redis command that took longer than the command timeout.
#[derive(Debug)]
struct CommandTimeout(Duration);

impl fmt::Display for CommandTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "redis did not answer within {:?}", self.0)
    }
}

impl std::error::Error for CommandTimeout {}

/// What one acquire attempt found.
enum Attempt {
    Granted {
        fence: u64,
    },
    /// Held by another token, which expires in this many ms (negative: no TTL).
    Held {
        ttl_ms: i64,
    },
}

impl Inner {
    async fn acquire(
        self: Arc<Self>,
        keys: Arc<RedisKeys>,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let started = Instant::now();
        let deadline = started
            .checked_add(wait)
            .unwrap_or_else(|| started + Duration::from_secs(86_400 * 365));
        let token = new_token().map_err(|error| {
            LockError::Backend(Box::new(std::io::Error::other(error.to_string())))
        })?;
        // Registered before the first attempt, so no release after it goes unnoticed.
        let interest = self.releases.register(&keys.lock);
        let mut in_flight = InFlight {
            inner: self.clone(),
            keys,
            token,
            sent_at: None,
        };
        let mut first = true;
        loop {
            let mut released = pin!(interest.notify.notified());
            released.as_mut().enable();

            let sent_at = Instant::now();
            // The first attempt gets a whole command timeout (a zero wait still tries
            // once); later ones end with the wait.
            let limit = match first {
                true => sent_at + self.config.command_timeout,
                false => (sent_at + self.config.command_timeout).min(deadline),
            };
            first = false;
            in_flight.sent_at = Some(sent_at);
            let attempt = self.attempt(&in_flight.keys, &in_flight.token);
            // On an error or timeout `in_flight` stays armed: its drop gives back what
            // the attempt may have been granted.
            let ttl_ms = match timeout_at(limit, attempt).await {
                Ok(Ok(Attempt::Granted { fence })) => {
                    in_flight.sent_at = None;
                    let (keys, token) = (in_flight.keys.clone(), in_flight.token.clone());
                    return Ok(self.grant(keys, token, fence, sent_at));
                }
                Ok(Ok(Attempt::Held { ttl_ms })) => ttl_ms,
                Ok(Err(error)) => return Err(LockError::Backend(Box::new(error))),
                Err(_) if limit == deadline => return Err(LockError::Timeout),
                Err(_) => {
                    let timeout = CommandTimeout(self.config.command_timeout);
                    return Err(LockError::Backend(Box::new(timeout)));
                }
            };
            in_flight.sent_at = None;
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout);
            }
            let pause = self.pause(ttl_ms).min(deadline - now);
            // Woken by a release message or the end of the pause, whichever is first.
            race(released, sleep(pause)).await;
            if Instant::now() >= deadline {
                return Err(LockError::Timeout);
            }
        }
    }

    /// How long to wait for a release message before trying again.
    fn pause(&self, holder_ttl_ms: i64) -> Duration {
        let mut poll = self.config.poll_interval;
        if !*self.subscribed.borrow() {
            poll = poll.min(UNSUBSCRIBED_POLL);
        }
        let pause = jitter(poll);
        match u64::try_from(holder_ttl_ms) {
            // One ms past the holder's expiry, the key is free.
            Ok(ttl) => pause.min(Duration::from_millis(ttl + 1)),
            Err(_) => pause,
        }
    }

    async fn attempt(&self, keys: &RedisKeys, token: &str) -> Result<Attempt, RedisError> {
        let fence_ttl = self
            .config
            .fence_ttl
            .map_or(0, |ttl| millis(ttl.max(self.config.lease)));
        // Outlasts this waiter's longest pause and its next attempt's round trip.
        let waiting_ttl = self.config.poll_interval + self.config.command_timeout;
        let (granted, value): (i64, i64) = self
            .acquire
            .key(&*keys.lock)
            .key(&keys.fence)
            .key(&keys.waiting)
            .arg(token)
            .arg(millis(self.config.first_ttl()))
            .arg(fence_ttl)
            .arg(millis(waiting_ttl))
            .invoke_async(&mut self.commands.clone())
            .await?;
        Ok(match granted {
            1 => Attempt::Granted {
                fence: u64::try_from(value).unwrap_or_default(),
            },
            _ => Attempt::Held { ttl_ms: value },
        })
    }

    /// A lease for a grant sent at `sent_at`, with its renewal task.
    fn grant(
        self: &Arc<Self>,
        keys: Arc<RedisKeys>,
        token: String,
        fence: u64,
        sent_at: Instant,
    ) -> Lease {
        let (lost, signal) = LeaseSignal::new();
        let renewal =
            tokio::spawn(
                self.clone()
                    .keep(keys.lock.clone(), token.clone(), sent_at, lost),
            );
        let release = RedisRelease {
            inner: self.clone(),
            keys,
            token,
            renewal: renewal.abort_handle(),
        };
        Lease::new(Some(fence), signal, release)
    }

    /// Keeps a lease acquired at `acquired_at` alive, and raises `lost` at its local
    /// deadline or at the first reply saying it is not ours. Aborted when the lease is
    /// released or dropped.
    async fn keep(
        self: Arc<Self>,
        lock: Arc<str>,
        token: String,
        acquired_at: Instant,
        lost: LeaseLostSender,
    ) {
        let config = &self.config;
        let period = config.lease / 3;
        let hold_end = config.max_hold.map(|max| acquired_at + max);
        // Invariant: the lease is valid (ours in Redis, modulo drift) until `valid_until`.
        let mut valid_until = acquired_at + config.first_ttl().saturating_sub(self.drift);
        let mut next = acquired_at + period;
        loop {
            let renew = config.renewal && hold_end.is_none_or(|end| next < end);
            if !renew {
                sleep_until(valid_until).await;
                break;
            }
            if let First(()) = race(sleep_until(valid_until), sleep_until(next)).await {
                break;
            }
            let sent = Instant::now();
            let ttl = hold_end
                .map_or(config.lease, |end| {
                    config.lease.min(end.saturating_duration_since(sent))
                })
                .max(Duration::from_millis(1));
            let limit = (sent + config.command_timeout).min(valid_until);
            match timeout_at(limit, self.renew(&lock, &token, ttl)).await {
                Ok(Ok(true)) => {
                    valid_until = sent + ttl.saturating_sub(self.drift);
                    next = sent + period;
                }
                // Definitely not ours any more: deleted, expired or taken over.
                Ok(Ok(false)) => break,
                // Unknown: try again soon; the deadline stands.
                Ok(Err(_)) | Err(_) => next = Instant::now() + period / 4,
            }
        }
        lost.lose();
    }

    async fn renew(&self, lock: &str, token: &str, ttl: Duration) -> Result<bool, RedisError> {
        let renewed: i64 = self
            .renew
            .key(lock)
            .arg(token)
            .arg(millis(ttl))
            .invoke_async(&mut self.commands.clone())
            .await?;
        Ok(renewed == 1)
    }

    /// Deletes the lock if `token` still holds it and announces the release. Returns
    /// after one try, bounded by the command timeout; if that gets no answer, tries
    /// again in the background with backoff until `expires`, when Redis drops the key
    /// by itself.
    async fn give_back(self: &Arc<Self>, keys: Arc<RedisKeys>, token: String, expires: Instant) {
        if self.try_give_back(&keys, &token).await {
            return;
        }
        let inner = self.clone();
        tokio::spawn(async move {
            let mut backoff = RESUBSCRIBE_MIN;
            while Instant::now() + backoff < expires {
                sleep(jitter(backoff)).await;
                if inner.try_give_back(&keys, &token).await {
                    return;
                }
                backoff = (backoff * 2).min(RESUBSCRIBE_MAX);
            }
            tracing::debug!("redis lock release failed; the key expires by its lease");
        });
    }

    /// One release attempt; whether Redis answered.
    async fn try_give_back(&self, keys: &RedisKeys, token: &str) -> bool {
        let mut invocation = self.release.key(&*keys.lock);
        invocation.key(&keys.waiting).arg(token).arg(&self.channel);
        let mut commands = self.commands.clone();
        let release = invocation.invoke_async::<i64>(&mut commands);
        match timeout(self.config.command_timeout, release).await {
            Ok(Ok(_)) => true,
            Ok(Err(error)) => {
                tracing::debug!(%error, "redis lock release failed");
                false
            }
            Err(_) => {
                tracing::debug!("redis lock release timed out");
                false
            }
        }
    }
}

/// An acquisition's token, armed while an attempt may have been granted without us
/// knowing: an error, a timeout, or the acquire future dropped mid-attempt. Then the
/// script may have run (or may still run: a silent server can wake up), so dropping
/// it gives back what the token may hold rather than leave the key blocked for a lease.
struct InFlight {
    inner: Arc<Inner>,
    keys: Arc<RedisKeys>,
    token: String,
    /// When the attempt in flight was sent; `None` when none is.
    sent_at: Option<Instant>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(sent_at) = self.sent_at else {
            return;
        };
        // Without a runtime (it is shutting down) the key expires by its lease.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (inner, keys) = (self.inner.clone(), self.keys.clone());
            let token = std::mem::take(&mut self.token);
            let expires = sent_at + inner.config.first_ttl();
            runtime.spawn(async move { inner.give_back(keys, token, expires).await });
        }
    }
}

/// Gives a Redis lease back: stops its renewal, then deletes the key if still ours.
struct RedisRelease {
    inner: Arc<Inner>,
    keys: Arc<RedisKeys>,
    token: String,
    renewal: AbortHandle,
}

impl ReleaseLease for RedisRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        self.renewal.abort();
        // No renewal can follow, so the key is gone from Redis within one lease.
        let expires = Instant::now() + self.inner.config.lease;
        Box::pin(async move {
            let (keys, token) = (self.keys.clone(), self.token.clone());
            self.inner.give_back(keys, token, expires).await;
        })
    }
}

impl Drop for RedisRelease {
    fn drop(&mut self) {
        // Also when dropped without `release` (no runtime left): renewal stops.
        self.renewal.abort();
    }
}

/// The Redis keys of one lock, in one hash slot.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RedisKeys {
    lock: Arc<str>,
    fence: String,
    /// Present while some instance waits for the lock: its release must publish.
    waiting: String,
}

impl RedisKeys {
    /// `prefix` is normalized (empty or ending with `:`, no braces).
    fn new(prefix: &str, name: &str, key: &str) -> Self {
        let tag = format!("{{{prefix}{}:{}}}", component(name), component(key));
        Self {
            lock: format!("{tag}:lock").into(),
            fence: format!("{tag}:fence"),
            waiting: format!("{tag}:waiting"),
        }
    }
}

/// A layer name or request key as it appears in a Redis key: as-is when short and
/// plain, else `#` + hex SHA-256. Plain text has no `#`, so the forms never collide.
fn component(text: &str) -> Cow<'_, str> {
    let plain = |b: u8| b.is_ascii_alphanumeric() || b"-_.@+=/~,".contains(&b);
    if !text.is_empty() && text.len() <= MAX_PLAIN_LEN && text.bytes().all(plain) {
        return Cow::Borrowed(text);
    }
    let mut hashed = String::with_capacity(65);
    hashed.push('#');
    push_hex(&mut hashed, &Sha256::digest(text.as_bytes()));
    Cow::Owned(hashed)
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
}

/// A fresh random 128-bit token, in hex.
fn new_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)?;
    let mut token = String::with_capacity(32);
    push_hex(&mut token, &bytes);
    Ok(token)
}

/// A random duration between half of `max` and `max`, so that instances woken by
/// the same event do not retry in lockstep.
fn jitter(max: Duration) -> Duration {
    let half = max / 2;
    let spread = u64::try_from((max - half).as_micros()).unwrap_or(u64::MAX);
    let random = getrandom::u64().unwrap_or(0);
    half + Duration::from_micros(random % spread.saturating_add(1))
}

/// Whole milliseconds, at least 1 (Redis rejects a zero `PX`).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// Waiters for the release of a lock key, woken by the subscription task.
#[derive(Default)]
struct Releases {
    waiting: Mutex<HashMap<Arc<str>, Waiters>>,
}

/// The waiters of one lock key.
struct Waiters {
    notify: Arc<Notify>,
    /// How many `Interest`s share `notify`; the entry goes with the last.
    interests: usize,
}

/// A waiter's registration; removes the entry with the last one.
struct Interest {
    releases: Arc<Releases>,
    lock: Arc<str>,
    notify: Arc<Notify>,
}

impl Releases {
    fn register(self: &Arc<Self>, lock: &Arc<str>) -> Interest {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let waiters = waiting.entry(lock.clone()).or_insert_with(|| Waiters {
            notify: Arc::new(Notify::new()),
            interests: 0,
        });
        waiters.interests += 1;
        Interest {
            releases: self.clone(),
            lock: lock.clone(),
            notify: waiters.notify.clone(),
        }
    }

    fn wake(&self, lock: &str) {
        let notify = {
            let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting.get(lock).map(|waiters| waiters.notify.clone())
        };
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        let all: Vec<_> = {
            let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting
                .values()
                .map(|waiters| waiters.notify.clone())
                .collect()
        };
        for notify in all {
            notify.notify_waiters();
        }
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut waiting = self
            .releases
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(waiters) = waiting.get_mut(&self.lock) {
            waiters.interests -= 1;
            if waiters.interests == 0 {
                waiting.remove(&self.lock);
            }
        }
    }
}

/// The release subscription: one RESP3 connection whose push messages wake waiters.
struct Subscriber {
    client: Client,
    channel: String,
    timeout: Duration,
}

/// A subscribed connection and its push messages.
type Subscription = (MultiplexedConnection, mpsc::UnboundedReceiver<PushInfo>);

impl Subscriber {
    fn new(client: &Client, channel: String, timeout: Duration) -> Result<Self, RedisError> {
        // Push messages need RESP3, whatever the command connection speaks.
        let info = client.get_connection_info().clone();
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        Ok(Self {
            client: Client::open(info.set_redis_settings(settings))?,
            channel,
            timeout,
        })
    }

    async fn subscribe(&self) -> Result<Subscription, RedisError> {
        let (sender, receiver) = mpsc::unbounded_channel();
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_push_sender(sender);
        let mut connection = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        connection.subscribe(&self.channel).await?;
        Ok((connection, receiver))
    }

    /// Delivers release messages until `stop` resolves (the backend is gone);
    /// resubscribes with backoff whenever the connection fails.
    async fn run(
        self,
        first: Subscription,
        releases: Arc<Releases>,
        subscribed: watch::Sender<bool>,
        mut stop: oneshot::Receiver<()>,
    ) {
        let mut current = Some(first);
        let mut backoff = RESUBSCRIBE_MIN;
        loop {
            let subscription = match current.take() {
                Some(subscription) => subscription,
                None => {
                    let attempt = timeout(self.timeout, self.subscribe());
                    let result = match race(&mut stop, attempt).await {
                        First(_) => return,
                        Second(result) => result,
                    };
                    match result {
                        Ok(Ok(subscription)) => {
                            tracing::debug!("redis release subscription restored");
                            // Releases while unsubscribed went unheard: everyone retries.
                            releases.wake_all();
                            subscription
                        }
                        Ok(Err(_)) | Err(_) => {
                            if let First(_) = race(&mut stop, sleep(jitter(backoff))).await {
                                return;
                            }
                            backoff = (backoff * 2).min(RESUBSCRIBE_MAX);
                            continue;
                        }
                    }
                }
            };
            backoff = RESUBSCRIBE_MIN;
            subscribed.send_replace(true);
            let stopped = self.listen(subscription, &releases, &mut stop).await;
            subscribed.send_replace(false);
            if stopped {
                return;
            }
            tracing::debug!("redis release subscription lost; resubscribing");
        }
    }

    /// Wakes waiters until the connection fails (`false`) or `stop` resolves (`true`).
    async fn listen(
        &self,
        (mut connection, mut messages): Subscription,
        releases: &Releases,
        stop: &mut oneshot::Receiver<()>,
    ) -> bool {
        let mut keepalive = tokio::time::interval(KEEPALIVE);
        keepalive.tick().await;
        loop {
            let event = race(&mut *stop, race(messages.recv(), keepalive.tick())).await;
            match event {
                First(_) => return true,
                Second(First(None)) => return false,
                Second(First(Some(push))) => match push.kind {
                    PushKind::Disconnection => return false,
                    PushKind::Message => {
                        if let Some(redis::Value::BulkString(lock)) = push.data.get(1) {
                            if let Ok(lock) = std::str::from_utf8(lock) {
                                releases.wake(lock);
                            }
                        }
                    }
                    _ => {}
                },
                Second(Second(_)) => {
                    let ping = redis::cmd("PING");
                    let answer =
                        timeout(self.timeout, ping.query_async::<()>(&mut connection)).await;
                    if !matches!(answer, Ok(Ok(()))) {
                        return false;
                    }
                }
            }
        }
    }
}

/// Which of two futures finished first.
enum Race<A, B> {
    First(A),
    Second(B),
}
use Race::{First, Second};

/// Polls both futures, `first` first, until one finishes (`tokio::select!` without the
/// `macros` feature).
async fn race<A: Future, B: Future>(first: A, second: B) -> Race<A::Output, B::Output> {
    let (mut first, mut second) = (pin!(first), pin!(second));
    poll_fn(|cx| {
        if let Poll::Ready(output) = first.as_mut().poll(cx) {
            return Poll::Ready(First(output));
        }
        second.as_mut().poll(cx).map(Second)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha256_hex(text: &str) -> String {
        let mut out = String::new();
        push_hex(&mut out, &Sha256::digest(text.as_bytes()));
        out
    }

    #[test]
    fn plain_names_and_keys_are_kept() {
        let keys = RedisKeys::new("keyed-lock:", "orders", "order-42");
        assert_eq!(&*keys.lock, "{keyed-lock:orders:order-42}:lock");
        assert_eq!(keys.fence, "{keyed-lock:orders:order-42}:fence");
        let keys = RedisKeys::new("", "a", "b");
        assert_eq!(&*keys.lock, "{a:b}:lock");
    }

    #[test]
    fn odd_or_long_text_is_hashed_with_a_marker() {
        for odd in ["a:b", "{x}", "*", "a b", "é", "#abc", &"k".repeat(65), ""] {
            assert_eq!(component(odd), format!("#{}", sha256_hex(odd)), "{odd:?}");
        }
        assert_eq!(component(&"k".repeat(64)), "k".repeat(64));
    }

    #[test]
    fn hashing_is_stable_across_builds_and_machines() {
        // The FIPS 180-2 test vector: SHA-256, not a per-process hasher.
        assert_eq!(component("abc:"), format!("#{}", sha256_hex("abc:")));
        assert_eq!(
            sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn names_and_keys_cannot_reach_each_other() {
        let triples = [
            ("p:", "a", "b:c"),
            ("p:", "a:b", "c"),
            ("p:a:", "b", "c"),
            ("p:", "a", "b"),
            ("", "p", "a:b"),
            ("p:a:b:", "c", "d"),
        ];
        let mut seen = std::collections::HashSet::new();
        for (prefix, name, key) in triples {
            let keys = RedisKeys::new(prefix, name, key);
            assert!(seen.insert(keys.lock.clone()), "{prefix} {name} {key}");
            let tag = keys.lock.strip_suffix(":lock").unwrap();
            assert_eq!(tag.matches('{').count(), 1);
            assert_eq!(tag.matches('}').count(), 1);
        }
    }

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
    fn tokens_are_fresh_128_bit_hex() {
        let (a, b) = (new_token().unwrap(), new_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn jitter_stays_between_half_and_all() {
        for _ in 0..100 {
            let d = jitter(Duration::from_millis(100));
            assert!(d >= Duration::from_millis(50) && d <= Duration::from_millis(100));
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn interests_share_an_entry_and_remove_it_with_the_last() {
        let releases = Arc::new(Releases::default());
        let lock: Arc<str> = "k".into();
        let a = releases.register(&lock);
        let b = releases.register(&lock);
        assert!(Arc::ptr_eq(&a.notify, &b.notify));
        drop(a);
        assert_eq!(releases.waiting.lock().unwrap().len(), 1);
        drop(b);
        assert!(releases.waiting.lock().unwrap().is_empty());
    }
}
