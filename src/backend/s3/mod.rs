//! Amazon S3 backend: serializes a key across every instance that shares an S3 bucket,
//! with one object per key taken by conditional writes (`If-None-Match`, `If-Match`).
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_keyed_lock::backend::{s3::S3Backend, SetupError};
//! use tower_keyed_lock::{DistributedLocks, KeyedLockLayer};
//!
//! # async fn run(config: aws_sdk_s3::Config) -> Result<(), SetupError> {
//! // `config` as your application loads it, e.g. with the `aws-config` crate.
//! let client = aws_sdk_s3::Client::from_conf(config);
//! let backend = S3Backend::builder(client, "my-locks")
//!     .lease(Duration::from_secs(20))
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
//! The client is AWS's own SDK, [`aws_sdk_s3`], the one the DynamoDB backend uses: the
//! backend uses the client's region, credentials, endpoint, addressing style and HTTP
//! client, and replaces its retry and timeout settings with its own (see
//! [`command_timeout`](S3BackendBuilder::command_timeout)). It needs Rust 1.94.1, as
//! that SDK does.
//!
//! # Object names
//!
//! A layer named `name` locks request key `key` with one object of the bucket:
//!
//! ```text
//! <prefix><name>/<key>
//! ```
//!
//! `name` and `key` are each written as etcd keys and Azure blob names are: every byte
//! outside ASCII letters, digits and `- _ . ~ : @ + = ,` escaped as `%XX`; when the
//! escaped form is empty or longer than 128 bytes, it is `#` followed by the lowercase
//! hex SHA-256 of the UTF-8 bytes instead. Distinct (name, key) pairs never share an
//! object. The prefix (default [`DEFAULT_PREFIX`], `"keyed-lock/"`, not empty, at most
//! 512 bytes) gets a trailing `/` if it has none. [`S3Backend::object_name`] computes a
//! name.
//!
//! # The object
//!
//! A few lines of text, rewritten whole by every write:
//!
//! ```text
//! tower-keyed-lock s3 1             the format; any other object is refused, not read
//! version 6c1f…                     random, new at every write: a new ETag every time
//! fence 1732360000000123            the fencing token of the latest grant
//! lease_ms 30000                    the holder's lease: how long waiters watch
//! owner 9a0e…                       the holder's random token; absent while free
//! since_ms 1732360000000            when it was granted (the holder's clock)
//! holder web-2:4242                 the holder's instance id
//! ```
//!
//! # How a key is held
//!
//! - **Attempt.** A `GetObject` reads the object, then one `PutObject` writes the
//!   grant (a fresh random 128-bit owner token and the next fencing token): with
//!   `If-None-Match: *` if there is no object, with `If-Match` on the ETag read if the
//!   object is free (released, not yet deleted) or its holder went stale (below). A
//!   412 (the condition failed) or a 409 (another conditional write on the object was
//!   under way) means another instance got in between: the object is read again once,
//!   then the attempt counts as "held" and the wait goes on; neither is ever an error
//!   to the caller. An attempt whose write got no answer may still have been applied,
//!   so its token is given back in the background: the acquire is cancel-safe.
//! - **Takeover, on the waiter's clock.** S3 has no expiry. As with DynamoDB, a waiter
//!   that finds the key held notes the object's ETag and starts a timer on its own
//!   monotonic clock when the answer arrives; if the ETag is unchanged a whole lease
//!   (the holder's, from the object) later, the holder stopped renewing, and the next
//!   attempt takes the object over with `If-Match` on that ETag. No clocks of
//!   different machines are compared. The holder wrote that ETag before the waiter
//!   saw it and counts its lease lost at its send time + lease − drift margin: before
//!   the takeover. The backend keeps what it saw per key (up to 16 384 keys) across
//!   acquisitions.
//! - **Fencing tokens.** A grant on an existing object counts on: its token plus one.
//!   S3 has no counter that survives a delete, so a new object starts from S3's clock
//!   in microseconds, at the most it can read when the write lands (the write counts
//!   as landed or lost two command timeouts after it was sent), and above every token
//!   this process has read or was granted. This process knows S3's clock from the
//!   `Date` of its answers: an interval, narrowed by every answer, that surely holds it.
//!   An object is deleted only once the bottom of that interval is past its token, so
//!   the next object of the key, whoever makes it, starts above every token of the
//!   deleted one: tokens never go back for a key.
//! - **Wait.** S3 has no notification: a waiter polls, after a jittered pause that
//!   doubles from 10 ms up to the [`poll_interval`](S3BackendBuilder::poll_interval),
//!   cut to the moment the watched ETag goes stale and to the end of the wait. Only the
//!   wait bounds it. Throttling (`SlowDown`, 503), S3's own failures (5xx) and calls
//!   with no answer are tried again within the wait; if the wait ends while S3 still
//!   fails, the acquisition fails with [`LockError::Backend`] (503), not
//!   [`LockError::Timeout`] (409). Any other refusal (denied, no such bucket, an object
//!   this crate did not write) ends it at once.
//! - **Validity.** The lease counts as valid until *send time of the grant, or of the
//!   last renewal that was answered, + lease − drift margin*, on the monotonic clock.
//!   At that instant the holder is told it is lost (even if S3 never answers again), as
//!   it is at the first renewal that finds the object gone or another owner's.
//! - **Renewal.** Every lease/3, a `PutObject` with `If-Match` on the lease's last
//!   ETag writes a new record version. If it is refused, a `GetObject` tells whether a
//!   write of ours landed unanswered (the object still names our token: renewed with
//!   its ETag) or the key is gone.
//! - **Release.** Once S3's clock is surely past the object's token, a `DeleteObject`
//!   with `If-Match` on the lease's ETag. Before that (a lease released within about
//!   two command timeouts of its grant), a `PutObject` with `If-Match` writes the
//!   record free (no owner; the token stays), and the object is deleted in the
//!   background once the clock is past, with `If-Match` on the free record's ETag (a
//!   key taken again meanwhile keeps its object). Either way the key is free at once
//!   for the next poll. If S3 cannot be reached within the command timeout, the
//!   release is retried in the background for a lease; after that, waiters take over.
//!
//! Every call is bounded by [`command_timeout`](S3BackendBuilder::command_timeout), and
//! the SDK's own retries are off (the lock polls and renews by itself). Errors name the
//! engine and where the client sends its requests (the scheme and host of its last
//! request; the region before any), then the cause: `S3 at http://127.0.0.1:9000:
//! dispatch failure: Connection refused (os error 111)`.
//!
//! # Who holds a key
//!
//! [`holder`](LockBackend::holder) reads the object (one `GetObject`): held while it
//! names an owner, by `holder` ([`instance_id`](S3BackendBuilder::instance_id)) since
//! `since_ms`, with the fencing token `fence`. S3 keeps no expiry: `lease_left` is
//! `None`, and a crashed holder is named until a waiter takes the key over.
//!
//! # Footprint
//!
//! The bucket keeps an object only for a key held, waited for, or released within the
//! [`record_window`] (two seconds and six command timeouts, 8 s by default). An object
//! left behind (its holder crashed, or the delete never got an answer) stays until the
//! key is locked and released again; an S3 lifecycle rule on the prefix can expire
//! such objects, and the next grant then starts again from S3's clock.
//!
//! # Timing rules
//!
//! | what | when |
//! |---|---|
//! | lease | default 30 s, at least 30 ms |
//! | renewal | every lease/3 after the last answered one; retried every lease/12 while unanswered |
//! | a holder counts its lease lost | send time of the last answered grant or renewal + lease − drift margin (default 1% of the lease + 2 ms), or at the first renewal that finds the object not ours |
//! | a waiter takes over a stopped holder | one lease (the holder's) after it first saw the object's ETag, unchanged since |
//! | one call (read, write, delete) | at most the command timeout (default 1 s); an attempt is two calls (read, write), three if the object changed in between |
//! | a released key's object is deleted | within the [`record_window`] |
//! | a waiter looks again | after a jittered pause doubling from 10 ms up to the poll interval (default 500 ms) |
//!
//! # What this backend does not guarantee
//!
//! - **Latency and cost.** Every grant is two requests, a release one or two, every
//!   renewal one, and waiters poll: a hand-off between instances takes up to a poll
//!   interval, and every poll is a billed `GetObject`. Suited to jobs and to keys held
//!   for a while, less to hot keys under high request rates.
//! - **Clock rate.** The takeover and the validity are durations measured on two
//!   processes' monotonic clocks; the drift margin must cover how much faster the
//!   holder's clock can run than a waiter's over one lease.
//! - **A stalled holder.** A holder whose process pauses past its lease loses the key
//!   to the next waiter; it learns it from
//!   [`LeaseSignal::is_lost`](crate::LeaseSignal::is_lost) at its next look. Use the
//!   fencing token where a late write must be refused.
//! - **Objects deleted by hand.** A deleted object takes its token with it; the next
//!   object starts from S3's clock, above every earlier token unless the object was
//!   deleted within two command timeouts (and the clock's doubt) of its last grant, or
//!   its tokens had counted more than a million grants a second. Keep the prefix for
//!   locks only.
//! - **S3-compatible stores.** The lock rests on S3's strongly consistent conditional
//!   writes (since 2024). A store that ignores the conditions is refused by
//!   [`build`](S3BackendBuilder::build); one that enforces them but is only eventually
//!   consistent is not detected. The tests run on moto.
//! - **Shared holders and permits.** One holder per key.
//!
//! # Setups refused
//!
//! [`build`](S3BackendBuilder::build) refuses, with a [`SetupError`] that names the
//! problem: a lease under 30 ms, a drift margin of half the lease or more, an empty
//! or too long prefix ([`SetupError::Invalid`]); a bucket that does not answer
//! `HeadBucket` (a 403 passes: a policy may grant the objects under the prefix only)
//! or refuses the probe's writes ([`SetupError::Failed`]); and a store that does not enforce
//! conditional writes ([`SetupError::Unsafe`]): a probe object under the prefix is
//! created with `If-None-Match: *`, created again the same way (which must be refused),
//! written with `If-Match` on another ETag (which must be refused too), then deleted.

// One concern per file: `names` maps keys to object names, `record` is the object's
// body, `object` the three calls on it, `lease` attempts, waits, renews and gives back
// (S3's steps of the `backend::ttl` engine), `holder` reads who holds a key, and
// `setup` checks the bucket and its conditional writes. This file has the public types
// and their configuration.
mod deployment;
mod holder;
mod lease;
mod names;
mod object;
mod record;
mod setup;

use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::Client;

use self::names::{object_name, object_prefix};
use super::aws::Endpoint;
use super::settings::{self, Defaults, Settings};
use super::{ttl, Acquisition, BoxFuture, Holder, LockBackend, SetupError};
use crate::error::LockError;
use crate::key::Key;

pub use self::object::S3LockError;

/// The default [`S3BackendBuilder::lease`].
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The shortest lease accepted: renewal runs every lease/3.
pub const MIN_LEASE: Duration = Duration::from_millis(30);
/// The default [`S3BackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);
/// The default [`S3BackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// The default [`S3BackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "keyed-lock/";
/// The shortest time [`build`](S3BackendBuilder::build) waits for each of its calls
/// (the command timeout if longer): a connection's first call is slower.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after a release a released key's object may stay, with a
/// [`command_timeout`](S3BackendBuilder::command_timeout) of `command_timeout`: until
/// S3's clock is surely past the object's fencing token (at most two command timeouts
/// and the clock's doubt, under a second once S3 answered at different moments of its
/// second), and three tries of the delete. See [Footprint](self#footprint).
pub fn record_window(command_timeout: Duration) -> Duration {
    Duration::from_secs(2) + 6 * command_timeout
}

/// How errors name the engine.
const ENGINE: &str = "S3";

/// S3's defaults and limits.
static DEFAULTS: Defaults = settings::defaults!(ENGINE, object_prefix);

/// A [`LockBackend`] on an S3 bucket: one client, shared by every clone. See the
/// [module docs](self).
#[derive(Clone)]
pub struct S3Backend {
    inner: Arc<Inner>,
}

/// Configures an [`S3Backend`]; made by [`S3Backend::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::{s3::S3Backend, SetupError};
///
/// # async fn run(client: aws_sdk_s3::Client) -> Result<(), SetupError> {
/// let backend = S3Backend::builder(client, "my-bucket")
///     .prefix("locks/billing/")
///     .lease(Duration::from_secs(10))
///     .command_timeout(Duration::from_millis(500))
///     .poll_interval(Duration::from_millis(200))
///     .build()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct S3BackendBuilder {
    client: Client,
    bucket: String,
    config: Settings,
}

/// What every clone of a backend shares.
struct Inner {
    client: Client,
    bucket: String,
    /// Where the client sends its requests, and S3's clock from the `Date` of its
    /// answers.
    endpoint: Arc<Endpoint>,
    config: Settings,
    /// The ETags seen on other holders' objects, for takeovers.
    watched: ttl::Watched,
    /// This backend, for the deletes it leaves to run in the background.
    this: Weak<Inner>,
}

impl S3Backend {
    /// A builder for a backend on `bucket`, through `client`.
    pub fn builder(client: Client, bucket: impl Into<String>) -> S3BackendBuilder {
        S3BackendBuilder {
            client,
            bucket: bucket.into(),
            config: Settings::new(&DEFAULTS),
        }
    }

    /// The name of the object of `key` for the layer called `name` (see
    /// [object names](self#object-names)).
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::s3::S3Backend;
    /// # async fn run(client: aws_sdk_s3::Client) -> Result<(), tower_keyed_lock::backend::SetupError> {
    /// let backend = S3Backend::builder(client, "my-bucket").build().await?;
    /// assert_eq!(backend.object_name("orders", "42"), "keyed-lock/orders/42");
    /// assert_eq!(backend.object_name("orders", "a/b"), "keyed-lock/orders/a%2Fb");
    /// # Ok(())
    /// # }
    /// ```
    pub fn object_name(&self, name: &str, key: &str) -> String {
        object_name(&self.inner.config.prefix, name, key)
    }

    /// The bucket the lock objects are in.
    pub fn bucket(&self) -> &str {
        &self.inner.bucket
    }
}

impl fmt::Debug for S3Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Backend")
            .field("bucket", &self.inner.bucket)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for S3BackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3BackendBuilder")
            .field("bucket", &self.bucket)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl S3BackendBuilder {
    settings::lease_settings!(config; instance_id lease renewal drift_margin command_timeout poll_interval prefix);

    /// Checks the settings and the bucket (see [Setups refused](self#setups-refused))
    /// and makes the backend. Its client is a copy of the given one with retries off
    /// (the backend retries by itself, within each request's wait) and every call
    /// bounded by the command timeout.
    pub async fn build(self) -> Result<S3Backend, SetupError> {
        let Self {
            client,
            bucket,
            config,
        } = self;
        let config = config.check()?;
        if bucket.is_empty() {
            return Err(SetupError::Invalid("the bucket name is empty".to_owned()));
        }
        let region = client.config().region().map(|region| region.to_string());
        let endpoint = Endpoint::new(region);
        let bounded = |limit: Duration| {
            let timeouts = TimeoutConfig::builder()
                .connect_timeout(limit)
                .operation_timeout(limit)
                .build();
            Client::from_conf(
                client
                    .config()
                    .to_builder()
                    .retry_config(RetryConfig::disabled())
                    .timeout_config(timeouts)
                    .interceptor(endpoint.interceptor())
                    .build(),
            )
        };
        let setup_limit = config.command_timeout.max(SETUP_TIMEOUT);
        setup::check(
            &bounded(setup_limit),
            &endpoint,
            &bucket,
            &config.prefix,
            setup_limit,
        )
        .await?;
        let client = bounded(config.command_timeout);
        let inner = Arc::new_cyclic(|this| Inner {
            client,
            bucket,
            endpoint,
            config,
            watched: ttl::Watched::default(),
            this: this.clone(),
        });
        Ok(S3Backend { inner })
    }
}

impl LockBackend for S3Backend {
    super::engine_head::engine_head!("s3", findings = deployment::findings);

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let object = Arc::new(self.object_name(name, key.as_str()));
        let inner = self.inner.clone();
        Box::pin(async move { ttl::acquire(&inner, &object, wait).await })
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let object = self.object_name(name, key.as_str());
        let inner = self.inner.clone();
        Box::pin(async move { inner.holder(object).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::setup_error::assert_invalid;
    use aws_sdk_s3::config::{BehaviorVersion, Region};

    fn builder() -> S3BackendBuilder {
        let config = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .build();
        S3Backend::builder(Client::from_conf(config), "locks")
    }

    #[tokio::test]
    async fn bad_settings_are_refused_by_name_before_any_call() {
        let refused = [
            (builder().lease(Duration::from_millis(29)), "lease"),
            (builder().drift_margin(Duration::from_secs(15)), "drift"),
            (builder().prefix(""), "prefix"),
            (builder().prefix(&"p".repeat(600)), "prefix"),
            (builder().command_timeout(Duration::ZERO), "command timeout"),
            (S3Backend::builder(builder().client, ""), "bucket"),
        ];
        for (builder, named) in refused {
            assert_invalid(builder.build().await, named);
        }
    }
}
