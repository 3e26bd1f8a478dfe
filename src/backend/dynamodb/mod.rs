//! DynamoDB backend: serializes a key across every instance that shares a DynamoDB
//! table, through conditional writes.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::backend::{dynamodb::DynamoDbBackend, SetupError};
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! # async fn pay() {}
//! # async fn app(config: aws_sdk_dynamodb::Config) -> Result<Router, SetupError> {
//! // `config` as your application loads it, e.g. with the `aws-config` crate.
//! let client = aws_sdk_dynamodb::Client::from_conf(config);
//! let backend = DynamoDbBackend::builder(client, "locks")
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
//! The backend uses the client's region, credentials, endpoint and HTTP client; it
//! replaces the client's retry and timeout settings with its own (see
//! [`command_timeout`](DynamoDbBackendBuilder::command_timeout)).
//!
//! # How a key is held
//!
//! - **Acquire.** One conditional `UpdateItem`: if the item has no owner, or its record
//!   version is one this waiter saw go stale (below), it writes a fresh random 128-bit
//!   owner token, a fresh random record version, the lease length, and increments the
//!   item's fence counter, returned with `UPDATED_NEW`: the fencing token
//!   ([`LockInfo::fencing_token`](crate::LockInfo::fencing_token)). When the condition
//!   fails the old item comes back (`ReturnValuesOnConditionCheckFailure`), so the
//!   waiter learns the holder's record version and lease without another read. An
//!   attempt whose answer never comes (error, timeout, or the acquire future dropped)
//!   may still have been applied, so its token is given back in the background: the
//!   acquire is cancel-safe by itself.
//! - **Takeover, on the waiter's clock.** No wall clock decides that a lease ran out
//!   (clocks of instances disagree). Instead, as in the AWS DynamoDB lock client, a
//!   waiter that finds the key held notes the record version and starts a timer on its
//!   own monotonic clock when the answer arrives. If the version is unchanged a whole
//!   lease (the one the holder wrote) later, the holder stopped renewing, and the next
//!   attempt takes the key over on the condition that the version is still that one.
//!   The backend keeps what it saw per key (up to 16 384 keys) across acquisitions, so
//!   waits shorter than a lease that follow one another take a crashed holder's key
//!   over too.
//!   The holder wrote that version before the waiter saw it, and declares its lease lost
//!   at its send time + lease − drift margin: before the takeover (see
//!   [Validity](#how-a-key-is-held)). The cost: a key whose holder crashed is free one
//!   lease after this instance first sees it held, however long ago the crash was.
//! - **Wait.** DynamoDB has no notification: a waiter polls, with jittered exponential
//!   backoff from 5 ms up to [`poll_interval`](DynamoDbBackendBuilder::poll_interval),
//!   cut to the moment the watched version goes stale and to the end of the request's
//!   wait. Only the wait bounds it, never a number of attempts.
//! - **Validity.** The lease counts as valid until *send time of the last successful
//!   acquire or renewal + lease − drift margin*, on the monotonic clock. At that instant
//!   it is declared lost (even if DynamoDB never answers again), as it is at the first
//!   answer saying the key is no longer ours; the handler sees it through
//!   [`LockInfo::lease`](crate::LockInfo::lease).
//! - **Renewal.** While held, a task writes a new record version every lease/3 with an
//!   update conditional on the owner token, and stops when the lease is released,
//!   dropped or lost.
//! - **Release.** A delete conditional on the owner token, once DynamoDB's clock is
//!   surely past the item's fence counter (see [Fencing tokens](#fencing-tokens)).
//!   Before that (a lease released within about two command timeouts of its grant),
//!   an update conditional on the owner token removes the owner, version and lease,
//!   and the item is deleted in the background once the clock is past, on the
//!   condition that nobody holds it by then. If DynamoDB cannot be reached within the
//!   command timeout, the release is retried in the background for a lease; after
//!   that, waiters take the key over.
//! - **Errors.** Throttling (`ProvisionedThroughputExceeded`, `RequestLimitExceeded`,
//!   `ThrottlingException`), DynamoDB's own failures (5xx) and calls that got no answer
//!   (the endpoint unreachable, a broken connection, the command timeout) are retried
//!   with backoff within the request's wait (a zero wait tries once); if the wait ends
//!   while DynamoDB is still refusing, failing or silent, the acquisition fails with [`LockError::Backend`] (503), not
//!   [`LockError::Timeout`] (409, which says the key is held). A refused write (a 4xx)
//!   is known not to be applied, so only an attempt whose outcome is unknown (a 5xx, a
//!   timeout, a broken connection) has its token given back. Every call is bounded by
//!   [`command_timeout`](DynamoDbBackendBuilder::command_timeout): an unreachable or
//!   silent endpoint fails the acquisition with [`LockError::Backend`] when its wait
//!   ends, and the layer answers 503 (or runs the request under its local lock with
//!   [`fail_open`](crate::KeyedLockLayer::fail_open)). Errors name the engine and where
//!   the client sends its requests (the scheme and host of its last request, read by an
//!   interceptor the backend adds to its copy of the client; the region before any),
//!   then the cause: `DynamoDB at http://127.0.0.1:8000: unhandled error: Connection
//!   refused (os error 111)`.
//!
//! # Fencing tokens
//!
//! The fence counter is set with `if_not_exists(lock_fence, :seed) + 1`: tokens grow
//! by one per grant while the item exists. A new item's seed is DynamoDB's clock in
//! microseconds, at the most it can read when the write lands (the write counts as
//! landed or lost two command timeouts after it was sent). This process knows that
//! clock from the `Date` of DynamoDB's answers: an interval, narrowed by every answer,
//! that surely holds it. An item is deleted only once the bottom of that interval is
//! past its fence counter, so the next item of the key, whoever makes it, starts above
//! every token of the deleted one, with no comparison of the instances' own clocks.
//! Before DynamoDB's first answer a seed is this machine's clock. A seed is also above
//! every token this process was granted, so an item deleted by hand (or by the table's
//! TTL) never sends this process's tokens back. Another instance's tokens hold across
//! an item deleted by hand, or a DynamoDB-compatible server that lost its items (moto
//! or DynamoDB Local restarted empty), once the server's clock is past the last token:
//! two command timeouts and the clock's doubt (up to a second) after the last grant.
//! Sooner, the next tokens can start below it (seen: 40 µs below, across a restart
//! within a second). DynamoDB itself does not lose items.
//!
//! So the table keeps an item only for a key held, waited for, or released within the
//! [`record_window`] (two seconds and six command timeouts, 8 s by default). An item
//! left behind (its holder crashed, or the delete never got an answer) stays until
//! the key is locked and released again, or until the table's TTL deletes it
//! [`item_ttl`](DynamoDbBackendBuilder::item_ttl) (default one day) after its last
//! write, outside this crate: a later grant starts again from DynamoDB's clock, which
//! is above every token of the old item unless that item counted more than a million
//! grants a second.

//! # The item
//!
//! A layer named `name` locks request key `key` in the item whose partition key
//! ([`partition_key`](DynamoDbBackendBuilder::partition_key), default `pk`) is
//! `<prefix><name>:<key>`, as a string, and whose sort key, if one is configured
//! ([`sort_key`](DynamoDbBackendBuilder::sort_key)), has the configured value:
//!
//! ```text
//! pk             S  "keyed-lock:orders:42"   the prefix, layer name and key
//! (sort key)     S  the configured value     single-table designs only
//! lock_owner     S  random hex               the holder's token; absent while free
//! lock_rvn       S  random hex               record version, new at every renewal
//! lock_lease_ms  N  30000                    the holder's lease, how long waiters watch
//! lock_fence     N  1732360000000123         the fencing token of the latest grant
//! lock_instance  S  "web-2:4242"             the holder's instance id, set by the grant
//! lock_since_ms  N  1732360000000            when it was granted (the holder's clock)
//! ttl            N  epoch seconds            lease + item_ttl after the last write
//! ```
//!
//! The key attributes and the TTL attribute are configurable; the `lock_*` names
//! are fixed, so a single-table design must leave them to the lock items.
//!
//! [`holder`](LockBackend::holder) reads the item (strongly consistent `GetItem`, one
//! call): held while `lock_owner` is there, by `lock_instance`
//! ([`instance_id`](DynamoDbBackendBuilder::instance_id)) since `lock_since_ms`, with
//! the fencing token `lock_fence`. The grant time is the granting instance's wall
//! clock (DynamoDB writes no server time); the lease left is `None`: no renewal time
//! is stored, waiters watch the record version instead.
//!
//! The prefix (default `"keyed-lock:"`, not empty) gets a trailing `:` if it has none. In the layer
//! name `%` and `:` are written `%25` and `%3A`, so the first `:` after the prefix ends
//! it. A key that starts with `#`, or that would make the partition key longer than
//! DynamoDB's 2048 bytes, is written as `#` and the hex SHA-256 of its bytes; no plain
//! key starts with `#`. [`DynamoDbBackend::partition_key_value`] computes the value.
//!
//! The table needs the partition key (and sort key, if configured) as strings, and TTL
//! on the TTL attribute ([`ttl_attribute`](DynamoDbBackendBuilder::ttl_attribute),
//! default `ttl`) to clean up items left behind by crashed holders.
//! [`DynamoDbBackendBuilder::create_table`] creates such a table (on-demand capacity)
//! for tests and local use.
//!
//! Conditional writes on one item are strongly consistent in DynamoDB, which is what
//! the exclusion rests on. Global tables replicate between regions with last-writer-wins:
//! lock from one region only.

// One concern per file: `item` lays out the lock item, `lease` acquires, renews and
// gives back leases, `retry` paces attempts and sorts errors, and `table` checks and
// creates the table, and `holder` reads who holds a key. This file has the public
// types and their configuration.
mod deployment;
mod holder;
mod item;
mod lease;
mod retry;
mod table;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
use aws_sdk_dynamodb::Client;

use self::item::{partition_value, Layout};
use super::settings::{self, Defaults, Settings};
use super::SetupError;
use super::{ttl, Acquisition, BoxFuture, Holder, LockBackend};
use crate::error::LockError;
use crate::key::Key;

/// The default [`DynamoDbBackendBuilder::lease`].
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default [`DynamoDbBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);
/// The default [`DynamoDbBackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// The default [`DynamoDbBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "keyed-lock:";
/// The default [`DynamoDbBackendBuilder::partition_key`].
pub const DEFAULT_PARTITION_KEY: &str = "pk";
/// The default [`DynamoDbBackendBuilder::ttl_attribute`].
pub const DEFAULT_TTL_ATTRIBUTE: &str = "ttl";
/// How long after a release a released key's item may stay, with a
/// [`command_timeout`](DynamoDbBackendBuilder::command_timeout) of `command_timeout`:
/// until DynamoDB's clock is surely past the item's fence counter (at most two
/// command timeouts and the clock's doubt, under a second once DynamoDB answered at
/// different moments of its second), and three tries of the delete. See
/// [Fencing tokens](self#fencing-tokens).
pub fn record_window(command_timeout: Duration) -> Duration {
    Duration::from_secs(2) + 6 * command_timeout
}

/// The default [`DynamoDbBackendBuilder::item_ttl`].
pub const DEFAULT_ITEM_TTL: Duration = Duration::from_secs(86_400);
/// The shortest lease accepted: renewal runs every lease/3.
pub const MIN_LEASE: Duration = Duration::from_millis(30);

/// A [`LockBackend`] on a DynamoDB table, shared by every clone. See the
/// [module docs](self).
#[derive(Clone)]
pub struct DynamoDbBackend {
    inner: Arc<Inner>,
}

/// Configures a [`DynamoDbBackend`]; made by [`DynamoDbBackend::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::{dynamodb::DynamoDbBackend, SetupError};
///
/// # async fn run(client: aws_sdk_dynamodb::Client) -> Result<(), SetupError> {
/// // One table for everything: the locks are items with sort key "lock".
/// let backend = DynamoDbBackend::builder(client, "app")
///     .partition_key("PK")
///     .sort_key("SK", "lock")
///     .ttl_attribute("expires_at")
///     .lease(Duration::from_secs(10))
///     .command_timeout(Duration::from_millis(500))
///     .build()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct DynamoDbBackendBuilder {
    client: Client,
    layout: Layout,
    config: Config,
}

#[derive(Clone, Debug)]
struct Config {
    settings: Settings,
    /// How long an item outlives its last write, beyond the lease.
    item_ttl: Duration,
}

/// DynamoDB's defaults and limits.
static DEFAULTS: Defaults = settings::defaults!(table::ENGINE, item_prefix);

/// A prefix as partition key values start with it: not empty (it keeps lock items
/// apart from the table's others), ending with `:`.
fn item_prefix(prefix: &str) -> Result<String, String> {
    if prefix.is_empty() {
        return Err("is empty: a prefix keeps lock items apart from the table's others".into());
    }
    Ok(settings::ending_with(prefix, ':'))
}

struct Inner {
    client: Client,
    /// Where the client sends its requests, for errors.
    endpoint: Arc<table::Endpoint>,
    layout: Layout,
    config: Config,
    watched: ttl::Watched,
}

impl DynamoDbBackend {
    /// Starts configuring a backend that locks in `table` through `client`.
    pub fn builder(client: Client, table: impl Into<String>) -> DynamoDbBackendBuilder {
        DynamoDbBackendBuilder {
            client,
            layout: Layout {
                table: table.into(),
                partition_key: DEFAULT_PARTITION_KEY.to_owned(),
                sort_key: None,
                ttl_attribute: DEFAULT_TTL_ATTRIBUTE.to_owned(),
            },
            config: Config {
                settings: Settings::new(&DEFAULTS),
                item_ttl: DEFAULT_ITEM_TTL,
            },
        }
    }

    /// The partition key value of the item that locks `key` for the layer called
    /// `name` (see [The item](self#the-item)).
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::dynamodb::DynamoDbBackend;
    /// # async fn run(client: aws_sdk_dynamodb::Client) {
    /// # let backend = DynamoDbBackend::builder(client, "locks").build().await.unwrap();
    /// assert_eq!(backend.partition_key_value("orders", "42"), "keyed-lock:orders:42");
    /// assert!(backend.partition_key_value("orders", "#x").starts_with("keyed-lock:orders:#"));
    /// # }
    /// ```
    pub fn partition_key_value(&self, name: &str, key: &str) -> String {
        partition_value(&self.inner.config.settings.prefix, name, key)
    }
}

impl fmt::Debug for DynamoDbBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDbBackend")
            .field("layout", &self.inner.layout)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for DynamoDbBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDbBackendBuilder")
            .field("layout", &self.layout)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl DynamoDbBackendBuilder {
    settings::lease_settings!(config.settings; instance_id lease renewal drift_margin command_timeout poll_interval prefix);

    /// The name of the table's partition key attribute (default
    /// [`DEFAULT_PARTITION_KEY`], `pk`), a string.
    pub fn partition_key(mut self, attribute: impl Into<String>) -> Self {
        self.layout.partition_key = attribute.into();
        self
    }

    /// The table's sort key attribute and the value it has in every lock item, for
    /// tables that have one (single-table designs). Default: no sort key.
    pub fn sort_key(mut self, attribute: impl Into<String>, value: impl Into<String>) -> Self {
        self.layout.sort_key = Some((attribute.into(), value.into()));
        self
    }

    /// The attribute the table's TTL is set on (default [`DEFAULT_TTL_ATTRIBUTE`],
    /// `ttl`): every write puts epoch seconds there.
    pub fn ttl_attribute(mut self, attribute: impl Into<String>) -> Self {
        self.layout.ttl_attribute = attribute.into();
        self
    }

    /// How long after its last write (plus one lease) an item may be deleted by the
    /// table's TTL (default [`DEFAULT_ITEM_TTL`], one day). See
    /// [Fencing tokens](self#fencing-tokens) for what a deletion does to the counter.
    pub fn item_ttl(mut self, ttl: Duration) -> Self {
        self.config.item_ttl = ttl;
        self
    }

    /// Creates the table this builder describes, if it does not exist: the partition
    /// key (and sort key) as strings, on-demand capacity, TTL on the TTL attribute. Waits
    /// until it is active. For tests and local use; production tables belong in your
    /// infrastructure code.
    pub async fn create_table(&self) -> Result<(), SetupError> {
        let (client, endpoint) = table::record(&self.client);
        let limit = self.config.settings.command_timeout;
        table::create(&client, &endpoint, &self.layout, limit).await
    }

    /// Checks that the table exists with the configured keys (one `DescribeTable`,
    /// within the command timeout) and makes the backend. Its client is a copy of the
    /// given one with retries off (the backend retries by itself, within each request's
    /// wait) and every call bounded by the command timeout.
    pub async fn build(self) -> Result<DynamoDbBackend, SetupError> {
        let Self {
            client,
            layout,
            config,
        } = self;
        let config = Config {
            settings: config.settings.check()?,
            ..config
        };
        let limit = config.settings.command_timeout;
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(limit)
            .operation_timeout(limit)
            .build();
        let client = Client::from_conf(
            client
                .config()
                .to_builder()
                .retry_config(RetryConfig::disabled())
                .timeout_config(timeouts)
                .build(),
        );
        let (client, endpoint) = table::record(&client);
        table::check(&client, &endpoint, &layout, limit).await?;
        Ok(DynamoDbBackend {
            inner: Arc::new(Inner {
                endpoint,
                client,
                layout,
                config,
                watched: Default::default(),
            }),
        })
    }
}

impl LockBackend for DynamoDbBackend {
    super::engine_head::engine_head!("dynamodb", findings = deployment::findings);

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let item =
            self.inner
                .layout
                .item_key(&self.inner.config.settings.prefix, name, key.as_str());
        let inner = self.inner.clone();
        Box::pin(async move { ttl::acquire(&inner, &Arc::new(item), wait).await })
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let item =
            self.inner
                .layout
                .item_key(&self.inner.config.settings.prefix, name, key.as_str());
        let inner = self.inner.clone();
        Box::pin(async move { inner.holder(item).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::config::{BehaviorVersion, Region};

    fn builder() -> DynamoDbBackendBuilder {
        let config = aws_sdk_dynamodb::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .build();
        DynamoDbBackend::builder(Client::from_conf(config), "locks")
    }

    #[test]
    fn the_prefix_gets_a_colon_and_must_not_be_empty() {
        let prefix = |prefix| {
            builder()
                .prefix(prefix)
                .config
                .settings
                .check()
                .map(|s| s.prefix)
        };
        assert_eq!(prefix("app").unwrap(), "app:");
        assert_eq!(prefix("app:").unwrap(), "app:");
        assert!(matches!(prefix(""), Err(SetupError::Invalid(_))));
    }

    #[test]
    fn a_sort_key_joins_the_item_key() {
        let builder = builder().partition_key("PK").sort_key("SK", "lock");
        let key = builder.layout.item_key("p:", "orders", "1");
        assert_eq!(key.len(), 2);
        assert_eq!(key["PK"].as_s().unwrap(), "p:orders:1");
        assert_eq!(key["SK"].as_s().unwrap(), "lock");
    }
}
