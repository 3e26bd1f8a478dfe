//! Azure's steps of the TTL-lease engine: an acquire attempt (read the blob, take its
//! lease conditionally on the ETag read, write the next fencing token under the new
//! lease), the polling between attempts, renewal and give-back as lease calls. The life
//! cycle around them is the engine's (`backend::ttl`).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use azure_core::error::ErrorKind;
use azure_core::http::headers::{HeaderName, Headers};
use azure_core::http::{Etag, Response, StatusCode};
use azure_storage_blob::models::{
    AppendBlobClientCreateOptions, AppendBlobClientCreateResultHeaders,
    BlobClientAcquireLeaseOptions, BlobClientAcquireLeaseResultHeaders, BlobClientDeleteOptions,
    BlobClientGetPropertiesResultHeaders, BlobClientSetMetadataOptions, LeaseState,
};
use azure_storage_blob::BlobClient;
use tokio::time::{sleep_until, timeout, timeout_at, Instant};

use super::metadata::{grant_metadata, FENCE};
use super::Inner;
use crate::backend::located::Located;
use crate::backend::settings::Settings;
use crate::backend::ttl::{
    give_back_call, Attempt, GiveBack, Granted, InFlight, PolledRecord, Renewal, Round,
};
use crate::LockError;

/// How many times a deferred delete of a released blob is sent while unanswered.
const DELETE_TRIES: u32 = 3;

/// A lock blob as a lease (or an attempt that may have become one) holds it.
#[derive(Clone)]
pub(super) struct Held {
    blob: Arc<BlobClient>,
    /// The grant: its fencing token and the blob's ETag after the token was written
    /// (`None` for an attempt that was not granted, or whose answer never came).
    grant: Option<(u64, Option<Etag>)>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why an Azure Blob lock call failed, besides the errors of `azure_core` (which come
/// boxed as they are). Reaches the application inside [`LockError::Backend`].
#[derive(Debug)]
#[non_exhaustive]
pub enum AzureBlobLockError {
    /// Azure did not answer one call within the command timeout.
    CommandTimeout(Duration),
    /// The blob's `fence` metadata is not a number: it was written by someone else.
    /// No token is issued rather than one that could go backwards.
    UnreadableFence(String),
}

impl fmt::Display for AzureBlobLockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CommandTimeout(limit) => {
                write!(f, "azure blob storage did not answer within {limit:?}")
            }
            Self::UnreadableFence(value) => write!(
                f,
                "the lock blob's `{FENCE}` metadata is not a number: {value:?}"
            ),
        }
    }
}

impl std::error::Error for AzureBlobLockError {}

/// Azure's error code of a refusal (`x-ms-error-code`, such as `ContainerNotFound`).
fn error_code(error: &azure_core::Error) -> Option<&str> {
    match error.kind() {
        ErrorKind::HttpResponse { error_code, .. } => error_code.as_deref(),
        _ => None,
    }
}

/// Whether Azure refused because the container is being deleted (it cannot be made
/// again, nor hold blobs, until the deletion is over: up to about 30 s on Azure).
fn being_deleted(error: &azure_core::Error) -> bool {
    error_code(error) == Some("ContainerBeingDeleted")
}

/// Whether another attempt later may succeed: no connection or no full answer, Azure
/// busy or failing (408, 429, 5xx), or the blob or container gone or being deleted (the
/// next attempt makes them again).
fn is_transient(error: &azure_core::Error) -> bool {
    match error.kind() {
        ErrorKind::Connection | ErrorKind::Io => true,
        ErrorKind::HttpResponse { status, .. } => {
            matches!(
                *status,
                StatusCode::NotFound
                    | StatusCode::RequestTimeout
                    | StatusCode::TooManyRequests
                    | StatusCode::InternalServerError
                    | StatusCode::BadGateway
                    | StatusCode::ServiceUnavailable
                    | StatusCode::GatewayTimeout
            ) || being_deleted(error)
        }
        _ => false,
    }
}

/// What one try to take a blob found.
enum Taken {
    /// The lease is ours, sent at `sent_at`, with this fencing token written under it.
    /// `etag`: the blob's after the write.
    Granted {
        fence: u64,
        etag: Option<Etag>,
        sent_at: Instant,
    },
    /// Leased by another holder, or taken between our read and our lease.
    Held,
    /// Free when read, but taken or gone before our lease: a release's deferred
    /// delete may have removed it in between, and then the key is free.
    Changed,
}

/// `token` (32 hex digits) as the GUID Azure wants for a lease id.
pub(super) fn lease_id(token: &str) -> String {
    let part = |range: std::ops::Range<usize>| token.get(range).unwrap_or("0");
    format!(
        "{}-{}-{}-{}-{}",
        part(0..8),
        part(8..12),
        part(12..16),
        part(16..20),
        part(20..32)
    )
}

/// The HTTP status of a refusal by Azure; `None` for a call with no answer.
fn status(error: &azure_core::Error) -> Option<StatusCode> {
    error.http_status()
}

/// Whether Azure refused a lease or conditional call because another lease holds the
/// blob, a lease id does not match, or the blob changed since it was read.
fn is_conflict(error: &azure_core::Error) -> bool {
    matches!(
        status(error),
        Some(StatusCode::Conflict | StatusCode::PreconditionFailed)
    )
}

/// Whether Azure refused a lease call or a delete because the lease is not ours (another
/// lease id, a broken or released lease) or the blob is gone.
fn not_ours(error: &azure_core::Error) -> bool {
    is_conflict(error) || status(error) == Some(StatusCode::NotFound)
}

/// The token after the one in `metadata`; a blob without one (new, deleted at a
/// release, or in a container made again) starts after `start`: Azure's clock when
/// the write lands, and above every token seen (`ServerClock::token_start`).
pub(super) fn next_fence(
    metadata: &HashMap<String, String>,
    start: u64,
) -> Result<u64, AzureBlobLockError> {
    match metadata.get(FENCE) {
        Some(value) => value
            .parse::<u64>()
            .map(|fence| fence.saturating_add(1))
            .map_err(|_| AzureBlobLockError::UnreadableFence(value.clone())),
        None => Ok(start.saturating_add(1)),
    }
}

impl Inner {
    /// `call`, answered within a command timeout and by `cap` (the end of the attempt).
    /// An answer's `Date` feeds Azure's clock.
    async fn bounded<T, F>(
        &self,
        cap: Instant,
        call: impl Future<Output = azure_core::Result<Response<T, F>>>,
    ) -> Result<azure_core::Result<Response<T, F>>, AttemptError> {
        let sent = Instant::now();
        let own = sent + self.config.command_timeout;
        match timeout_at(own.min(cap), call).await {
            Ok(answer) => {
                if let Ok(response) = &answer {
                    self.observe(response.headers(), sent);
                }
                Ok(answer)
            }
            Err(_) if own <= cap => Err(AttemptError::Lock(AzureBlobLockError::CommandTimeout(
                self.config.command_timeout,
            ))),
            Err(_) => Err(AttemptError::WaitOver),
        }
    }

    /// Takes Azure's clock from the `Date` of an answer to a request sent at `sent`.
    fn observe(&self, headers: &Headers, sent: Instant) {
        let received = Instant::now();
        let date = headers
            .get_optional_str(&HeaderName::from_static("date"))
            .and_then(|date| azure_core::time::parse_rfc7231(date).ok())
            .and_then(|date| u64::try_from(date.unix_timestamp()).ok());
        if let Some(secs) = date {
            self.clock.observe(secs, sent, received);
        }
    }

    /// Read the blob, take its lease if free and unchanged since the read, and write
    /// the next fencing token under that lease. A missing blob is made with the next
    /// token in it, and its lease taken unchanged since it was made.
    async fn attempt_once(
        &self,
        blob: &BlobClient,
        in_flight: &mut InFlight<Self>,
        cap: Instant,
    ) -> Result<Taken, AttemptError> {
        let properties = match self.bounded(cap, blob.get_properties(None)).await? {
            Ok(properties) => properties,
            Err(error) if status(&error) == Some(StatusCode::NotFound) => {
                let fence = next_fence(
                    &HashMap::new(),
                    self.clock.token_start(self.config.command_timeout),
                )?;
                match self.create(blob, fence, cap).await? {
                    Some(made) => {
                        let lease = self.take_lease(blob, in_flight, cap, Some(made)).await?;
                        return Ok(lease.map_or(Taken::Held, |(etag, sent_at)| {
                            self.clock.saw_token(fence);
                            Taken::Granted {
                                fence,
                                etag,
                                sent_at,
                            }
                        }));
                    }
                    // Made by another instance meanwhile.
                    None => self.bounded(cap, blob.get_properties(None)).await??,
                }
            }
            Err(error) => return Err(error.into()),
        };
        if matches!(
            properties.lease_state()?,
            Some(LeaseState::Leased | LeaseState::Breaking)
        ) {
            return Ok(Taken::Held);
        }
        let metadata = properties.metadata()?;
        let fence = next_fence(
            &metadata,
            self.clock.token_start(self.config.command_timeout),
        )?;
        if metadata.contains_key(FENCE) {
            self.clock.saw_token(fence - 1);
        }
        let Some((etag, sent_at)) = self
            .take_lease(blob, in_flight, cap, properties.etag()?)
            .await?
        else {
            return Ok(Taken::Changed);
        };
        let metadata = grant_metadata(fence, &self.config.instance_id);
        let write = blob.set_metadata(
            &metadata,
            Some(BlobClientSetMetadataOptions {
                lease_id: Some(in_flight.token().to_owned()),
                if_match: etag,
                ..Default::default()
            }),
        );
        match self.bounded(cap, write).await? {
            Ok(written) => {
                self.clock.saw_token(fence);
                let etag = written
                    .headers()
                    .get_optional_str(&HeaderName::from_static("etag"))
                    .map(Etag::from);
                Ok(Taken::Granted {
                    fence,
                    etag,
                    sent_at,
                })
            }
            // Broken or changed in between: the grant does not count, and the guard
            // gives back the lease if it is still ours.
            Err(error) if is_conflict(&error) => Ok(Taken::Held),
            Err(error) => Err(error.into()),
        }
    }

    /// Takes the blob's lease for `in_flight`'s token if the blob is unchanged since
    /// `read` (its ETag): the ETag after (lease calls leave it as it was) and when the
    /// call was sent, or `None` if another lease holds the blob or it changed.
    async fn take_lease(
        &self,
        blob: &BlobClient,
        in_flight: &mut InFlight<Self>,
        cap: Instant,
        read: Option<Etag>,
    ) -> Result<Option<(Option<Etag>, Instant)>, AttemptError> {
        let sent_at = Instant::now();
        in_flight.sent(sent_at);
        let acquire = blob.acquire_lease(
            self.lease_secs,
            Some(BlobClientAcquireLeaseOptions {
                proposed_lease_id: Some(in_flight.token().to_owned()),
                if_match: read.clone(),
                ..Default::default()
            }),
        );
        match self.bounded(cap, acquire).await? {
            Ok(acquired) => Ok(Some((acquired.etag()?.or(read), sent_at))),
            Err(error) if status(&error).is_some() => {
                // Refused: nothing was granted.
                in_flight.answered();
                match is_conflict(&error) {
                    true => Ok(None),
                    false => Err(error.into()),
                }
            }
            Err(error) => Err(error.into()),
        }
    }

    /// Makes the lock blob with `fence` and this instance in its metadata, never over
    /// an existing one (`If-None-Match: *`), and returns its ETag; `None` if another
    /// instance made it first (or Azure gave no ETag: the attempt reads the blob then).
    /// If the container is gone, makes it again first.
    async fn create(
        &self,
        blob: &BlobClient,
        fence: u64,
        cap: Instant,
    ) -> Result<Option<Etag>, AttemptError> {
        let append = blob.append_blob_client();
        let metadata = grant_metadata(fence, &self.config.instance_id);
        let create = || {
            append.create(Some(AppendBlobClientCreateOptions {
                metadata: Some(metadata.clone()),
                ..AppendBlobClientCreateOptions::default().if_not_exists()
            }))
        };
        match self.bounded(cap, create()).await? {
            Ok(made) => return Ok(made.etag()?),
            // The container is being deleted: the attempt fails, the wait goes on.
            Err(error) if being_deleted(&error) => return Err(error.into()),
            Err(error) if is_conflict(&error) => return Ok(None),
            // The container is gone (deleted, or an emulator restarted empty).
            Err(error) if status(&error) == Some(StatusCode::NotFound) => {}
            Err(error) => return Err(error.into()),
        }
        self.make_container(cap).await?;
        match self.bounded(cap, create()).await? {
            Ok(made) => Ok(made.etag()?),
            Err(error) if being_deleted(&error) => Err(error.into()),
            Err(error) if is_conflict(&error) => Ok(None),
            Err(error) => Err(error.into()),
        }
    }

    /// Makes the lost container again, as `build` made it. Its blobs, and so their
    /// counters, are gone: the next tokens start from the clock or from the highest
    /// token this process has seen, whichever is higher (see [`next_fence`]).
    async fn make_container(&self, cap: Instant) -> Result<(), AttemptError> {
        match self.bounded(cap, self.container.create(None)).await? {
            Ok(_) => {
                tracing::warn!(
                    container = %self.address,
                    "the lock container was gone; made it again"
                );
                Ok(())
            }
            Err(error) if being_deleted(&error) => Err(error.into()),
            // Made again by another instance meanwhile.
            Err(error) if status(&error) == Some(StatusCode::Conflict) => Ok(()),
            Err(error) => Err(error.into()),
        }
    }
}

/// Why an attempt ended without an answer: ours, Azure's, or the wait was over first.
enum AttemptError {
    Lock(AzureBlobLockError),
    Azure(azure_core::Error),
    WaitOver,
}

impl AttemptError {
    /// Whether another attempt within the wait may succeed.
    fn transient(&self) -> bool {
        match self {
            Self::Lock(AzureBlobLockError::CommandTimeout(_)) => true,
            Self::Lock(_) | Self::WaitOver => false,
            Self::Azure(error) => is_transient(error),
        }
    }

    fn into_boxed(self) -> BoxError {
        match self {
            Self::Lock(error) => Box::new(error),
            Self::Azure(error) => Box::new(error),
            Self::WaitOver => Box::new(LockError::Timeout),
        }
    }
}

impl From<AzureBlobLockError> for AttemptError {
    fn from(error: AzureBlobLockError) -> Self {
        Self::Lock(error)
    }
}

impl From<azure_core::Error> for AttemptError {
    fn from(error: azure_core::Error) -> Self {
        Self::Azure(error)
    }
}

/// Deletes a released blob at `due`, when Azure's clock is surely past its token, if
/// it is still as the grant left it (`If-Match: etag`; a new grant rewrites the
/// metadata) and unleased (Azure refuses to delete a leased blob without its lease
/// id). Sent again while unanswered, up to [`DELETE_TRIES`] times.
async fn delete_released(blob: Arc<BlobClient>, etag: Etag, due: Instant, limit: Duration) {
    sleep_until(due).await;
    for _ in 0..DELETE_TRIES {
        let options = BlobClientDeleteOptions {
            if_match: Some(etag.clone()),
            ..Default::default()
        };
        match timeout(limit, blob.delete(Some(options))).await {
            Ok(Ok(_)) => return,
            // Refused: changed, leased or gone.
            Ok(Err(error)) if status(&error).is_some_and(|status| status.is_client_error()) => {
                return
            }
            Ok(Err(error)) => tracing::debug!(%error, "azure blob delete after release failed"),
            Err(_) => tracing::debug!("azure blob delete after release timed out"),
        }
    }
}

impl PolledRecord for Inner {
    type Key = Arc<BlobClient>;
    type Held = Held;

    const ENGINE: &'static str = "azure-blob";
    const FIRST_POLL: Duration = Duration::from_millis(10);

    fn settings(&self) -> &Settings {
        &self.config
    }

    fn unanswered(blob: &Arc<BlobClient>) -> Held {
        Held {
            blob: blob.clone(),
            grant: None,
        }
    }

    fn token(fresh: String) -> String {
        lease_id(&fresh)
    }

    /// One attempt, read again once if the blob changed between its read and the lease
    /// (see [`Taken::Changed`]): a key freed by a release is never answered "held"
    /// because its blob was being deleted meanwhile.
    async fn try_grant(
        self: &Arc<Self>,
        blob: &Arc<BlobClient>,
        in_flight: &mut InFlight<Self>,
        round: Round,
    ) -> Attempt<Granted<Held>> {
        let mut taken = self.attempt_once(blob, in_flight, round.limit).await;
        if let Ok(Taken::Changed) = taken {
            taken = self.attempt_once(blob, in_flight, round.limit).await;
        }
        match taken {
            Ok(Taken::Granted {
                fence,
                etag,
                sent_at,
            }) => {
                let held = Held {
                    blob: blob.clone(),
                    grant: Some((fence, etag)),
                };
                Attempt::Granted(Granted {
                    held,
                    fence,
                    sent_at,
                })
            }
            Ok(Taken::Held | Taken::Changed) => Attempt::Held { free_by: None },
            Err(AttemptError::WaitOver) => Attempt::OutOfTime(None),
            // No answer, Azure busy, or the container gone (made again by the next
            // attempt): tried again within the wait.
            Err(error) if error.transient() => Attempt::Retry(error.into_boxed()),
            Err(error) => Attempt::Failed(error.into_boxed()),
        }
    }

    async fn renew_by(&self, held: &Held, token: &str, limit: Instant) -> Renewal {
        let renew = held.blob.renew_lease(token.to_owned(), None);
        match timeout_at(limit, renew).await {
            Ok(Ok(_)) => Renewal::Renewed,
            Ok(Err(error)) if not_ours(&error) => Renewal::NotOurs,
            Ok(Err(_)) | Err(_) => Renewal::Unknown,
        }
    }

    /// One release attempt. The blob goes with the lease (`Delete Blob` with the lease
    /// id) once Azure's clock is surely past its token: a later blob of the key then
    /// starts above it (`ServerClock::token_start`). Until then the lease is released, and the
    /// blob is deleted once the clock is past, if it is unleased and unchanged since
    /// the grant's write by then (`If-Match`).
    async fn give_back(&self, held: &Held, token: &str) -> GiveBack {
        let blob = &held.blob;
        let limit = self.config.command_timeout;
        match &held.grant {
            Some((fence, _)) if self.clock.is_past(*fence) => {
                let options = BlobClientDeleteOptions {
                    lease_id: Some(token.to_owned()),
                    ..Default::default()
                };
                let delete = blob.delete(Some(options));
                give_back_call("azure blob delete", limit, delete, not_ours).await
            }
            grant => {
                let release = blob.release_lease(token.to_owned(), None);
                let given_back =
                    give_back_call("azure blob lease release", limit, release, not_ours).await;
                if let (GiveBack::Cleared, Some((fence, Some(etag)))) = (&given_back, grant) {
                    if let Some(due) = self.clock.surely_past(*fence) {
                        let (blob, etag) = (blob.clone(), etag.clone());
                        tokio::spawn(delete_released(blob, etag, due, limit));
                    }
                }
                given_back
            }
        }
    }

    /// `error` inside [`LockError::Backend`], after the engine and the container.
    fn named(&self, error: BoxError) -> LockError {
        LockError::Backend(Box::new(Located::new(
            super::ENGINE,
            self.address.clone(),
            error,
        )))
    }

    fn no_answer(&self) -> BoxError {
        Box::new(AzureBlobLockError::CommandTimeout(
            self.config.command_timeout,
        ))
    }
}
