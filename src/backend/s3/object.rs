//! The three calls on a lock object — read it, write it on a condition, delete it on a
//! condition — each bounded by the command timeout, with S3's answers sorted into what
//! the lock needs to know: done, refused by its condition, or failed (in passing or
//! for good, maybe applied or surely not).

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use aws_sdk_s3::error::SdkError;
use aws_sdk_s3::primitives::ByteStream;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;
use tokio::time::{timeout_at, Instant};

use super::record::Record;
use super::Inner;

type BoxError = Box<dyn StdError + Send + Sync>;

/// S3's "not now" answers besides every 5xx: another attempt may succeed.
const TRANSIENT_CODES: &[&str] = &["SlowDown", "RequestTimeout", "ServiceUnavailable"];

/// Why an S3 lock call failed, besides the SDK's own errors (which come boxed as they
/// are). Reaches the application inside [`LockError::Backend`](crate::LockError::Backend).
#[derive(Debug)]
#[non_exhaustive]
pub enum S3LockError {
    /// S3 did not answer one call within the command timeout.
    CommandTimeout(Duration),
    /// A lock object's body was not written by this crate: no token is issued from it
    /// rather than one that could go backwards.
    UnreadableObject(String),
    /// A write succeeded but S3 gave no ETag: the lock cannot condition its next write.
    NoETag,
}

impl fmt::Display for S3LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CommandTimeout(limit) => write!(f, "s3 did not answer within {limit:?}"),
            Self::UnreadableObject(body) => {
                write!(f, "a lock object was not written by this crate: {body}")
            }
            Self::NoETag => f.write_str("s3 answered a write without an ETag"),
        }
    }
}

impl StdError for S3LockError {}

/// A call that failed: whether another attempt may succeed, whether a write may have
/// been applied all the same, or whether the caller's own end (`cap`) came first.
pub(super) struct CallError {
    pub(super) error: BoxError,
    pub(super) transient: bool,
    pub(super) maybe_applied: bool,
    /// Cut at the end of the attempt, before the command timeout: not S3's failure.
    pub(super) cut: bool,
}

impl CallError {
    fn sdk<E>(error: SdkError<E>) -> Self
    where
        E: ProvideErrorMetadata + StdError + Send + Sync + 'static,
    {
        CallError {
            transient: crate::backend::aws::is_transient(&error, TRANSIENT_CODES),
            // A refusal (a 4xx) was not applied; a 5xx or no answer leaves it unknown.
            maybe_applied: !status(&error).is_some_and(|status| (400..500).contains(&status)),
            error: Box::new(error),
            cut: false,
        }
    }

    fn local(error: S3LockError, maybe_applied: bool) -> Self {
        CallError {
            transient: matches!(error, S3LockError::CommandTimeout(_)),
            error: Box::new(error),
            maybe_applied,
            cut: false,
        }
    }
}

/// The HTTP status of an answer; `None` for a call with no answer.
pub(super) fn status<E>(error: &SdkError<E>) -> Option<u16> {
    error.raw_response().map(|raw| raw.status().as_u16())
}

/// Whether S3 refused a write because its condition did not hold (412), or because
/// another conditional write on the object was in progress (409): either way not
/// applied, and another attempt is the answer.
fn is_condition_refused<E>(error: &SdkError<E>) -> bool {
    matches!(status(error), Some(412 | 409))
}

/// A lock object as read: its ETag and record.
pub(super) struct Found {
    pub(super) etag: String,
    pub(super) record: Record,
}

/// What a conditional write or delete found.
pub(super) enum Outcome<T> {
    /// Applied.
    Done(T),
    /// Its condition did not hold (412), or another write was under way (409).
    Refused,
    /// No such object (a delete, or a write conditional on an ETag, found none).
    Gone,
}

/// The condition of a write.
pub(super) enum Condition<'a> {
    /// Only if no object exists (`If-None-Match: *`).
    Absent,
    /// Only if the object's ETag is this one (`If-Match`).
    Matches(&'a str),
}

impl Inner {
    /// `call`, answered within a command timeout and by `cap`.
    async fn bounded<T>(
        &self,
        cap: Instant,
        call: impl Future<Output = Result<T, CallError>>,
    ) -> Result<T, CallError> {
        let own = Instant::now() + self.config.command_timeout;
        match timeout_at(own.min(cap), call).await {
            Ok(result) => result,
            Err(_) => Err(CallError {
                cut: cap < own,
                ..CallError::local(
                    S3LockError::CommandTimeout(self.config.command_timeout),
                    true,
                )
            }),
        }
    }

    /// Reads `object`: `None` if there is none.
    pub(super) async fn read(
        &self,
        object: &str,
        cap: Instant,
    ) -> Result<Option<Found>, CallError> {
        let call = async {
            let answer = self
                .client
                .get_object()
                .bucket(&self.bucket)
                .key(object)
                .send()
                .await;
            let output = match answer {
                Ok(output) => output,
                Err(error) if status(&error) == Some(404) => return Ok(None),
                Err(error) => return Err(CallError::sdk(error)),
            };
            let etag = output.e_tag().map(str::to_owned);
            let body = output.body.collect().await.map_err(|error| CallError {
                error: Box::new(error),
                transient: true,
                maybe_applied: false,
                cut: false,
            })?;
            let record = Record::parse(&body.into_bytes())
                .map_err(|body| CallError::local(S3LockError::UnreadableObject(body), false))?;
            let etag = etag.ok_or_else(|| CallError::local(S3LockError::NoETag, false))?;
            Ok(Some(Found { etag, record }))
        };
        let mut found = self.bounded(cap, call).await;
        if let Err(error) = &mut found {
            // A read changes nothing.
            error.maybe_applied = false;
        }
        found
    }

    /// Writes `record` with a fresh record version to `object` if `condition` holds:
    /// the new ETag.
    pub(super) async fn write(
        &self,
        object: &str,
        record: &Record,
        condition: Condition<'_>,
        cap: Instant,
    ) -> Result<Outcome<String>, CallError> {
        let version = crate::backend::ttl::fresh_token().map_err(|error| CallError {
            error: Box::new(error),
            transient: false,
            maybe_applied: false,
            cut: false,
        })?;
        let put = self
            .client
            .put_object()
            .bucket(&self.bucket)
            .key(object)
            .content_type("text/plain")
            .body(ByteStream::from(record.render(&version)));
        let put = match condition {
            Condition::Absent => put.if_none_match("*"),
            Condition::Matches(etag) => put.if_match(etag),
        };
        let call = async {
            match put.send().await {
                Ok(output) => match output.e_tag() {
                    Some(etag) => Ok(Outcome::Done(etag.to_owned())),
                    None => Err(CallError::local(S3LockError::NoETag, true)),
                },
                Err(error) if is_condition_refused(&error) => Ok(Outcome::Refused),
                Err(error) if status(&error) == Some(404) => Ok(Outcome::Gone),
                Err(error) => Err(CallError::sdk(error)),
            }
        };
        self.bounded(cap, call).await
    }

    /// Deletes `object` if its ETag is `etag`.
    pub(super) async fn delete(
        &self,
        object: &str,
        etag: &str,
        cap: Instant,
    ) -> Result<Outcome<()>, CallError> {
        let delete = self
            .client
            .delete_object()
            .bucket(&self.bucket)
            .key(object)
            .if_match(etag);
        let call = async {
            match delete.send().await {
                Ok(_) => Ok(Outcome::Done(())),
                Err(error) if is_condition_refused(&error) => Ok(Outcome::Refused),
                Err(error) if status(&error) == Some(404) => Ok(Outcome::Gone),
                Err(error) => Err(CallError::sdk(error)),
            }
        };
        self.bounded(cap, call).await
    }
}
