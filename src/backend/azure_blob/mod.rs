//! Azure Blob Storage backend: serializes a key across every instance that shares a
//! storage container, with a blob lease per holder and a fencing token in the blob's
//! metadata.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_keyed_lock::backend::{azure_blob::AzureBlobBackend, SetupError};
//! use tower_keyed_lock::{DistributedLocks, KeyedLockLayer};
//!
//! # async fn run() -> Result<(), SetupError> {
//! // A container URL with a SAS token (or `.credential(..)` for Microsoft Entra ID).
//! let url = "https://myaccount.blob.core.windows.net/locks?sv=2022-11-02&ss=b&srt=co&sp=rwdlac&se=2030-01-01T00:00:00Z&spr=https&sig=...";
//! let backend = AzureBlobBackend::builder(url)
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
//! The client is Microsoft's own SDK, [`azure_storage_blob`] with [`azure_core`]: it
//! has the whole lease API (acquire with a proposed lease id, renew, release, break)
//! and the conditional headers (`If-Match`, `If-None-Match`, lease ids) the lock needs,
//! follows the service's API versions, and is kept by the service's owner. It is built
//! without its default features: reqwest with rustls only (no gzip or deflate, which
//! lock calls never use). It authenticates with a SAS token in the URL or a Microsoft
//! Entra ID credential; it has no shared-key signing, so an account key is used by
//! making a SAS from it. It needs Rust 1.88.
//!
//! # Blob names
//!
//! A layer named `name` locks request key `key` with one blob of the container:
//!
//! ```text
//! <prefix><name>/<key>        an empty append blob; metadata `fence` = last token
//! ```
//!
//! `name` and `key` are each written as etcd keys are: every byte outside ASCII
//! letters, digits and `- _ . ~ : @ + = ,` escaped as `%XX` (so `/`, `%`, `#`, spaces and
//! non-ASCII never appear raw); when the escaped form is empty or longer than 128
//! bytes, it is `#` followed by the lowercase hex SHA-256 of the UTF-8 bytes instead
//! (stable across builds and machines). A part that would end with `.` ends with `%2E`
//! instead (Azure advises against names ending with a dot). Distinct (name, key) pairs
//! never share a blob, and no blob name is longer than the prefix plus 261 bytes. The
//! prefix (default [`DEFAULT_PREFIX`], `"keyed-lock/"`, at most 512 bytes) gets a
//! trailing `/` if it has none. [`AzureBlobBackend::blob_name`] computes a name. A
//! released key's blob is deleted (see Release below): the container keeps a blob
//! only for a key held, waited for, or released within the [`record_window`].
//!
//! # How a key is held
//!
//! - **Attempt.** Read the blob's properties. If its lease state is leased or breaking,
//!   the key is held. Otherwise acquire its lease for
//!   [`lease`](AzureBlobBackendBuilder::lease), with a fresh random lease id and
//!   `If-Match` on the ETag read, then write the next fencing token to the blob's
//!   metadata with that lease id and the ETag again. Only when that write succeeded
//!   is the lock granted; a refusal anywhere means another holder got in between. A
//!   missing blob is made with the next token already in its metadata
//!   (`If-None-Match: *`, so no creation ever clobbers one), and its lease acquired
//!   with `If-Match` on the creation's ETag: granted with the token it was made with.
//! - **A lost container.** If the blob cannot be made because the container is gone
//!   (deleted, an account emptied, an in-memory Azurite restarted), the attempt makes
//!   the container again, as [`build`](AzureBlobBackendBuilder::build) does (another
//!   instance making it first is fine), then the blob. While Azure still deletes the
//!   old one (`ContainerBeingDeleted`, up to about 30 s on Azure) the attempt fails and
//!   the wait goes on. Tokens in the new container still go up (see
//!   [what a deletion does](#blobs-deleted-by-hand)).
//! - **Fencing token.** The metadata counter plus one: written under the new lease in
//!   one conditional request, so the tokens of one blob strictly increase from holder
//!   to holder (a holder whose write failed or went unanswered never uses its token;
//!   the next one counts on from whatever was written). A blob without a counter (new,
//!   or deleted and made again) starts from Azure's clock in microseconds, at the most
//!   it can read when the write lands (the write counts as landed or lost two command
//!   timeouts after it was sent). This process knows that clock from the `Date` of
//!   Azure's answers: an interval, narrowed by every answer, that surely holds it.
//! - **Wait.** Azure has no notification of a released lease: a waiter polls, after
//!   a jittered pause that doubles from 10 ms up to the
//!   [`poll_interval`](AzureBlobBackendBuilder::poll_interval), until the request's
//!   wait is over — never a number of attempts. Instances do not queue: whoever polls
//!   first after a release wins. An attempt that failed for a transient reason (no
//!   connection or no answer within the command timeout, Azure busy or failing: 408,
//!   429, 5xx; the blob or container gone or being deleted) is tried again the same
//!   way within the wait; the acquisition fails with that error only when the wait is
//!   over. Any other refusal (a credential refused, a foreign `fence`) ends it at once.
//! - **Validity.** The lease counts as valid until *send time of the acquire, or of the
//!   last renewal that was answered, + lease − drift margin*, on the monotonic clock;
//!   Azure counts the same lease from when it received the request, later. At that
//!   instant the holder is told the lease is lost (even if Azure never answers again),
//!   as it is at the first renewal refused (a broken, released or taken-over lease, a
//!   deleted blob): never later than its own deadline.
//! - **Renewal.** Every lease/3, a renew-lease call with the lease id; retried every
//!   lease/12 while unanswered. It stops when the lease is released, dropped or lost.
//! - **Release.** Once Azure's clock is surely past the token, a `Delete Blob` with
//!   the lease id: the blob goes with the lease, and the next blob of the key, whoever
//!   makes it, starts above every token of this one. Before that (a lease released
//!   within about two command timeouts of its grant), a release-lease call, and the
//!   blob is deleted in the background once the clock is past, if it is unleased and
//!   unchanged since the grant (`If-Match`). Either way the key is free at once for
//!   the next poll. If Azure cannot be reached within the command timeout, the
//!   release is retried in the background until the lease would have expired anyway.
//! - **Cancel safety.** From the moment the acquire-lease call is sent, a guard
//!   releases the lease if the acquisition ends without handing it over (an error, the
//!   wait over, the acquire future dropped at any await, an answer that never came).
//!
//! Every call is bounded by [`command_timeout`](AzureBlobBackendBuilder::command_timeout),
//! and the SDK's own retries are off (the lock polls and renews by itself): when Azure
//! is down or silent, acquisitions keep trying until their wait is over, then fail with
//! [`LockError::Backend`] (a zero wait tries once) and the layer answers 503 (or runs
//! the request under its local lock with
//! [`fail_open`](crate::KeyedLockLayer::fail_open)). Errors name the engine and the
//! container's URL without its query (never the SAS token), then the cause:
//! `Azure Blob Storage at http://127.0.0.1:10000/devstoreaccount1/locks: failed to
//! execute `reqwest` request: Connection refused (os error 111)`.
//!
//! # Who holds a key
//!
//! [`holder`](LockBackend::holder) reads the blob's properties (one call): held while
//! its lease is `leased` (or `breaking`), by the instance in the `holder` metadata
//! ([`instance_id`](AzureBlobBackendBuilder::instance_id)) since `since_ms` (the
//! holder's clock), with the fencing token in `fence`. The holder writes these with the
//! fencing token, in the one `Set Blob Metadata` under its new lease that completes its
//! grant; between the lease and that write (one round trip) a reader sees the previous
//! holder's entries. Azure does not tell how long a lease has left: `lease_left` is
//! `None`.
//!
//! # Timing rules
//!
//! | what | when |
//! |---|---|
//! | lease (Azure's range: 15 to 60 s, whole seconds) | default 30 s; rounded up to whole seconds for Azure, counted locally as set |
//! | renewal | every lease/3 after the last answered one; retried every lease/12 while unanswered |
//! | a holder counts its lease lost | send time of the last answered acquire or renewal + lease − drift margin (default 1% of the lease + 2 ms), or at the first renewal refused |
//! | Azure frees a stopped holder's blob | one lease after it received the last acquire or renewal |
//! | one call (read, create, acquire, metadata write, renew, release, delete) | at most the command timeout (default 2 s); an attempt is three calls (read, lease, token; or read, make with the token, lease) |
//! | a released key's blob is deleted | within the [`record_window`]: two seconds and six command timeouts (14 s by default) |
//! | one acquisition | ends with its wait, or one command timeout after its last attempt started if that is later (a zero wait tries once); transient failures tried again within it |
//! | a lost container | made again by the next attempt (two more calls); while Azure still deletes it, attempts fail and the wait goes on |
//! | a waiter looks again | after a jittered pause doubling from 10 ms up to the poll interval (default 500 ms) |
//!
//! # What this backend does not guarantee
//!
//! - **Latency and cost.** Every grant is three calls to the storage service, a
//!   release one more, and waiters poll: a hand-off between instances takes up to a
//!   poll interval, and every poll is a billed read. Suited to jobs and to keys held
//!   for a while, less to hot keys under high request rates.
//! - **Clock rate.** Validity is a duration measured on two clocks (this process's and
//!   the storage service's); the drift margin must cover how much faster this clock
//!   can run than Azure's over one lease (and the interval that holds Azure's clock
//!   allows 1 %). No wall clocks of the instances are compared.
//! - **A stalled holder.** A holder whose process pauses past its lease loses the key
//!   to the next waiter; it learns it from [`LeaseSignal::is_lost`](crate::LeaseSignal::is_lost)
//!   at its next look (by the clock alone), not before. Use the fencing token where a
//!   late write must be refused.
//! - **Leases broken by hand.** A `break lease` with a break period of zero frees the
//!   blob at once: another instance can take it before the holder's next renewal
//!   tells it (up to lease/3 later). A break with the default period (the rest of the
//!   lease) keeps the blob until the lease would have ended, after the holder's own
//!   deadline: the holder is told first.
//! - **A container deleted while keys are held.** Azure deletes a container whatever
//!   its blobs' leases: every key in it is free at once, and the next attempt makes
//!   the container again and is granted (about 40 ms on Azurite) while the holders are
//!   told only at their next renewal (up to lease/3 later; measured: 4.8 to 5.0 s with
//!   a 15 s lease). As with a lease broken at once, use the fencing token (higher for
//!   the new holder) where that overlap matters, and never delete the lock container
//!   while it is in use.
//! - <a id="blobs-deleted-by-hand"></a>**Blobs deleted by hand.** Deleting a blob
//!   (Azure refuses while it is leased, unless the lease id is given) takes its
//!   counter with it. The next grant makes the blob again and starts the counter from
//!   Azure's clock, which is above every token issued before as long as the old
//!   counter had not run ahead of that clock (fewer than a million grants per second
//!   of the old blob's life) and the blob was deleted more than two command timeouts
//!   after its last grant. The same holds for an account or container emptied,
//!   deleted (the next attempt makes it again) or restored from a backup. On top of
//!   the clock, a blob without a counter starts above the highest token this process
//!   has read or written on any blob since it started: within one process tokens
//!   never go back. Keep the container for locks only.
//! - **Azurite is not Azure.** The tests run against Azurite, Microsoft's emulator
//!   (its lease rules and conditional headers); Azure's own latency, throttling (503
//!   "server busy", tried again within the wait) and failovers are not exercised.
//!   Azurite run with `--location` (state on disk) forgets leases across a graceful
//!   restart: blobs come back unleased, so instance B was granted a key while A still
//!   counted itself its holder (until A's next renewal was refused). That is Azurite's
//!   behaviour, not Azure's (Azure keeps a lease for its whole duration); run Azurite
//!   in memory, or restart it only with no lock held. An in-memory Azurite restarted
//!   comes back without the container: it is made again (see above).
//! - **Shared holders and permits.** One holder per key.
//!
//! # Setups refused
//!
//! [`build`](AzureBlobBackendBuilder::build) refuses, with a [`SetupError`] that names
//! the problem: a URL that is not a container URL, a lease outside Azure's 15 to 60 s,
//! a drift margin of half the lease or more, a prefix longer than 512 bytes; and a
//! container that neither exists nor can be created with the credential given.

// One concern per file: `names` maps keys to blob names, `lease` attempts, waits,
// renews and gives back (Azure's steps of the `backend::ttl` engine), `holder` reads
// the blob's lease state and holder metadata. This file has the public types and their
// configuration.
mod deployment;
mod holder;
mod lease;
mod metadata;
mod names;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use azure_core::credentials::TokenCredential;
use azure_core::http::{ClientOptions, RetryOptions, StatusCode, Url};
use azure_storage_blob::{BlobContainerClient, BlobContainerClientOptions};

use self::names::{blob_name, with_slash, MAX_PREFIX_LEN};
use super::settings::{self, Defaults, Settings};
use super::{ttl, Acquisition, BoxFuture, Holder, LockBackend, SetupError};
use crate::backend::located::with_cause;
use crate::backend::server_clock::ServerClock;
use crate::error::LockError;
use crate::key::Key;

pub use self::lease::AzureBlobLockError;

/// How long after a release a released key's blob may stay, with a
/// [`command_timeout`](AzureBlobBackendBuilder::command_timeout) of `command_timeout`:
/// until Azure's clock is surely past the blob's token (at most two command timeouts
/// and the clock's doubt, under a second once Azure answered at different moments of
/// its second), and three tries of the delete.
pub fn record_window(command_timeout: Duration) -> Duration {
    Duration::from_secs(2) + 6 * command_timeout
}

/// The default [`AzureBlobBackendBuilder::lease`].
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The shortest lease Azure grants.
pub const MIN_LEASE: Duration = Duration::from_secs(15);
/// The longest lease Azure grants (short of an infinite one, which a lock never asks).
pub const MAX_LEASE: Duration = Duration::from_secs(60);
/// The default [`AzureBlobBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// The default [`AzureBlobBackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// The shortest time [`build`](AzureBlobBackendBuilder::build) waits for Azure to
/// answer (the command timeout if longer): a connection's first call is slower.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// The default [`AzureBlobBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "keyed-lock/";

/// A [`LockBackend`] on an Azure Blob Storage container: one client, shared by every
/// clone. See the [module docs](self).
#[derive(Clone)]
pub struct AzureBlobBackend {
    inner: Arc<Inner>,
}

/// Configures an [`AzureBlobBackend`]; made by [`AzureBlobBackend::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::azure_blob::AzureBlobBackend;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = AzureBlobBackend::builder("https://myaccount.blob.core.windows.net/locks?sig=...")
///     .lease(Duration::from_secs(15))
///     .command_timeout(Duration::from_secs(1))
///     .poll_interval(Duration::from_millis(200))
///     .prefix("billing/")
///     .build()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct AzureBlobBackendBuilder {
    container_url: String,
    credential: Option<Arc<dyn TokenCredential>>,
    config: Settings,
}

/// Azure Blob's defaults and limits.
static DEFAULTS: Defaults = settings::defaults!(ENGINE, blob_prefix, max_lease = MAX_LEASE);

/// A prefix as blob names start with it: ending with `/`, and short enough to leave
/// room for the layer's name and the key in a blob name.
fn blob_prefix(prefix: &str) -> Result<String, String> {
    let prefix = with_slash(prefix);
    if prefix.len() > MAX_PREFIX_LEN {
        return Err(format!(
            "is {} bytes, more than {MAX_PREFIX_LEN}",
            prefix.len()
        ));
    }
    Ok(prefix)
}

/// What every clone of a backend shares.
struct Inner {
    container: BlobContainerClient,
    /// The container's URL as errors show it (no query: never the SAS token).
    address: Arc<str>,
    config: Settings,
    /// The lease asked of Azure, in whole seconds.
    lease_secs: i32,
    /// Azure's clock, from the `Date` of its answers, and the highest token this
    /// process has read or written on any blob: a blob without a counter (new,
    /// deleted, or in a container made again) starts above both.
    clock: ServerClock,
}

/// How errors name the engine.
const ENGINE: &str = "Azure Blob Storage";

/// `url` as errors show it: without its query (a SAS token), fragment or user info.
fn shown(url: &Url) -> String {
    let mut shown = url.clone();
    shown.set_query(None);
    shown.set_fragment(None);
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown.to_string()
}

impl AzureBlobBackend {
    /// A builder for a backend on the container at `container_url`
    /// (`https://<account>.blob.core.windows.net/<container>`, with a SAS token as its
    /// query unless a [`credential`](AzureBlobBackendBuilder::credential) is given).
    pub fn builder(container_url: impl Into<String>) -> AzureBlobBackendBuilder {
        AzureBlobBackendBuilder {
            container_url: container_url.into(),
            credential: None,
            config: Settings::new(&DEFAULTS),
        }
    }

    /// A backend with the defaults, on the container at `container_url`.
    pub async fn connect(container_url: impl Into<String>) -> Result<Self, SetupError> {
        Self::builder(container_url).build().await
    }

    /// The name of the blob of `key` for the layer called `name` (see
    /// [blob names](self#blob-names)).
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::azure_blob::AzureBlobBackend;
    /// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
    /// # let backend = AzureBlobBackend::connect("http://127.0.0.1:10000/devstoreaccount1/locks?sig=...").await?;
    /// assert_eq!(backend.blob_name("orders", "42"), "keyed-lock/orders/42");
    /// assert_eq!(backend.blob_name("orders", "a/b"), "keyed-lock/orders/a%2Fb");
    /// # Ok(())
    /// # }
    /// ```
    pub fn blob_name(&self, name: &str, key: &str) -> String {
        blob_name(&self.inner.config.prefix, name, key)
    }

    /// The container client the backend uses, for the application's own calls.
    pub fn container(&self) -> &BlobContainerClient {
        &self.inner.container
    }
}

impl fmt::Debug for AzureBlobBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AzureBlobBackend")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for AzureBlobBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL's query may hold a SAS signature: never printed.
        f.debug_struct("AzureBlobBackendBuilder")
            .field("config", &self.config)
            .field("credential", &self.credential.is_some())
            .finish_non_exhaustive()
    }
}

impl AzureBlobBackendBuilder {
    settings::lease_settings!(config; instance_id lease renewal drift_margin command_timeout poll_interval prefix);

    /// Authenticates with Microsoft Entra ID (for example `azure_identity`'s
    /// credentials) instead of a SAS token in the URL; the URL must then be `https`.
    pub fn credential(mut self, credential: Arc<dyn TokenCredential>) -> Self {
        self.credential = Some(credential);
        self
    }

    /// Checks the settings (see [Setups refused](self#setups-refused)) and creates the
    /// container if it does not exist.
    pub async fn build(self) -> Result<AzureBlobBackend, SetupError> {
        let Self {
            container_url,
            credential,
            config,
        } = self;
        let config = config.check()?;
        let url = Url::parse(&container_url)
            .ok()
            .filter(|url| {
                url.path_segments()
                    .is_some_and(|mut s| s.any(|s| !s.is_empty()))
            })
            .ok_or_else(|| SetupError::Invalid("not a container URL".to_owned()))?;
        let options = BlobContainerClientOptions {
            client_options: ClientOptions {
                // The lock bounds, retries and polls every call itself.
                retry: RetryOptions::none(),
                ..Default::default()
            },
            ..Default::default()
        };
        let address: Arc<str> = shown(&url).into();
        let container = BlobContainerClient::new(url, credential, Some(options))
            .map_err(|error| SetupError::Invalid(error.to_string()))?;
        ensure_container(
            &container,
            &address,
            config.command_timeout.max(SETUP_TIMEOUT),
        )
        .await?;
        let lease_secs = i32::try_from(config.lease.as_millis().div_ceil(1000)).unwrap_or(60);
        Ok(AzureBlobBackend {
            inner: Arc::new(Inner {
                container,
                address,
                config,
                lease_secs,
                clock: ServerClock::default(),
            }),
        })
    }
}

/// Creates the container unless it exists; a credential that may not create one is
/// fine if it can see the container.
async fn ensure_container(
    container: &BlobContainerClient,
    address: &str,
    limit: Duration,
) -> Result<(), SetupError> {
    let failed = |error: azure_core::Error| {
        let cause = format!("the lock container is not usable: {}", with_cause(&error));
        SetupError::failed(ENGINE, address, cause)
    };
    let timed_out = |_| SetupError::no_answer(ENGINE, address, limit);
    let created = tokio::time::timeout(limit, container.create(None))
        .await
        .map_err(timed_out)?;
    match created {
        Ok(_) => Ok(()),
        Err(error) if error.http_status() == Some(StatusCode::Conflict) => Ok(()),
        Err(error) if error.http_status() == Some(StatusCode::Forbidden) => {
            match tokio::time::timeout(limit, container.exists()).await {
                Ok(Ok(true)) => Ok(()),
                Ok(Ok(false)) => Err(failed(error)),
                Ok(Err(error)) => Err(failed(error)),
                Err(elapsed) => Err(timed_out(elapsed)),
            }
        }
        Err(error) => Err(failed(error)),
    }
}

impl LockBackend for AzureBlobBackend {
    super::engine_head::engine_head!("azure-blob");

    fn check_configuration(&self) -> BoxFuture<Vec<crate::backend::Finding>> {
        let findings = deployment::findings(&self.inner);
        Box::pin(async move { findings })
    }

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let blob = self.blob_name(name, key.as_str());
        let blob = Arc::new(self.inner.container.blob_client(&blob));
        let inner = self.inner.clone();
        Box::pin(async move { ttl::acquire(&inner, &blob, wait).await })
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let blob = self
            .inner
            .container
            .blob_client(&self.blob_name(name, key.as_str()));
        let inner = self.inner.clone();
        Box::pin(async move { inner.holder(blob).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::setup_error::assert_invalid;

    #[tokio::test]
    async fn settings_outside_azures_range_are_refused_by_name() {
        let base = AzureBlobBackend::builder("http://127.0.0.1:1/a/c");
        let refused = [
            (base.clone().lease(Duration::from_secs(14)), "lease"),
            (base.clone().lease(Duration::from_secs(61)), "lease"),
            (base.clone().drift_margin(Duration::from_secs(15)), "drift"),
            (base.clone().prefix(&"p".repeat(600)), "prefix"),
            (AzureBlobBackend::builder("not a url"), "container URL"),
            (
                AzureBlobBackend::builder("http://127.0.0.1:1/"),
                "container URL",
            ),
        ];
        for (builder, named) in refused {
            assert_invalid(builder.build().await, named);
        }
    }

    #[test]
    fn lease_ids_are_guids() {
        assert_eq!(
            lease::lease_id("0123456789abcdef0123456789abcdef"),
            "01234567-89ab-cdef-0123-456789abcdef"
        );
    }

    #[test]
    fn the_fence_counts_on_or_starts_after_the_start() {
        use std::collections::HashMap;
        let stored = HashMap::from([(metadata::FENCE.to_owned(), "41".to_owned())]);
        assert_eq!(lease::next_fence(&stored, 0).unwrap(), 42);
        // A counter counts on, wherever a new blob would start.
        assert_eq!(lease::next_fence(&stored, u64::MAX / 2).unwrap(), 42);
        // A blob without a counter starts after the start.
        let start = 1_800_000_000_000_000;
        assert_eq!(
            lease::next_fence(&HashMap::new(), start).unwrap(),
            start + 1
        );
        let garbage = HashMap::from([(metadata::FENCE.to_owned(), "x".to_owned())]);
        assert!(lease::next_fence(&garbage, 0).is_err());
    }
}
