//! S3's steps of the TTL-lease engine: an acquire attempt (read the object, then
//! create it, take it over or take it free, each by a conditional write), the polling
//! between attempts, renewal and give-back as conditional writes and deletes. The life
//! cycle around them is the engine's (`backend::ttl`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{sleep_until, Instant};

use super::object::{CallError, Condition, Found, Outcome, S3LockError};
use super::record::Record;
use super::Inner;
use crate::backend::holder::unix_millis;
use crate::backend::located::Located;
use crate::backend::settings::Settings;
use crate::backend::ttl::{
    self, Attempt, GiveBack, Granted, InFlight, PolledRecord, Renewal, Round,
};
use crate::LockError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How many times a deferred delete of a released object is sent while unanswered.
const DELETE_TRIES: u32 = 3;

/// A lock object as a lease (or an attempt that may have become one) holds it.
#[derive(Clone)]
pub(super) struct Held {
    object: Arc<String>,
    /// The grant's record (`None` for an attempt whose answer never came).
    granted: Option<Record>,
    /// The ETag of this lease's last write that was answered; `None` when unknown (a
    /// write whose answer never came may have landed): the next call reads it first.
    etag: Arc<Mutex<Option<String>>>,
}

impl Held {
    fn etag(&self) -> Option<String> {
        self.etag.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_etag(&self, etag: Option<String>) {
        *self.etag.lock().unwrap_or_else(|e| e.into_inner()) = etag;
    }
}

/// What one attempt found.
enum Taken {
    /// Written, sent at `sent_at`: this record, and the object's ETag after.
    Granted {
        record: Record,
        etag: String,
        sent_at: Instant,
    },
    /// Held by another; `free_by`: when its record goes stale, as this process saw it.
    Held { free_by: Option<Instant> },
}

impl Inner {
    /// The record a grant writes now.
    fn grant_record(&self, token: &str, fence: u64) -> Record {
        Record {
            owner: Some(token.to_owned()),
            fence,
            lease: self.config.lease,
            instance: Some(self.config.instance_id.to_string()),
            since_ms: Some(unix_millis(std::time::SystemTime::now())),
        }
    }

    /// One attempt: read the object, then write the grant if the key is free (no
    /// object: created with `If-None-Match: *`; a released one: `If-Match` on its
    /// ETag) or its holder's ETag stayed unchanged for its lease as this process saw
    /// it (`If-Match` on that ETag). A write refused because the object changed in
    /// between reads it again, once.
    async fn take(
        &self,
        object: &str,
        in_flight: &mut InFlight<Self>,
        cap: Instant,
    ) -> Result<Taken, CallError> {
        for _ in 0..2 {
            let found = self.read(object, cap).await?;
            let now = Instant::now();
            let (condition, fence) = match &found {
                None => {
                    self.watched.saw(object, None, now);
                    // No counter survives a delete: a new object starts from S3's
                    // clock, above every token of a deleted one (see `give_back`).
                    let start = self.clock().token_start(self.config.command_timeout);
                    (Condition::Absent, start.saturating_add(1))
                }
                Some(Found { etag, record }) => {
                    self.clock().saw_token(record.fence);
                    if record.owner.is_some() {
                        let version = ttl::Version {
                            version: etag.clone(),
                            lease: record.lease,
                        };
                        let free_by = self.watched.saw(object, Some(version), now);
                        let stale = self.watched.stale_version(object, now);
                        if stale.as_deref() != Some(etag.as_str()) {
                            return Ok(Taken::Held { free_by });
                        }
                        tracing::debug!(object, "taking over a lock object unchanged for a lease");
                    } else {
                        self.watched.saw(object, None, now);
                    }
                    (Condition::Matches(etag), record.fence.saturating_add(1))
                }
            };
            let record = self.grant_record(in_flight.token(), fence);
            let sent_at = Instant::now();
            in_flight.sent(sent_at);
            match self.write(object, &record, condition, cap).await {
                Ok(Outcome::Done(etag)) => {
                    return Ok(Taken::Granted {
                        record,
                        etag,
                        sent_at,
                    })
                }
                // Changed (or deleted) since the read: nothing written.
                Ok(Outcome::Refused | Outcome::Gone) => in_flight.answered(),
                Err(error) => {
                    if !error.maybe_applied {
                        in_flight.answered();
                    }
                    return Err(error);
                }
            }
        }
        Ok(Taken::Held { free_by: None })
    }

    fn clock(&self) -> &crate::backend::server_clock::ServerClock {
        &self.endpoint.clock
    }

    /// The ETag and record of `object` if `token` holds it; `None` if it does not (no
    /// object, or another owner's).
    async fn read_ours(
        &self,
        object: &str,
        token: &str,
        cap: Instant,
    ) -> Result<Option<Found>, CallError> {
        let found = self.read(object, cap).await?;
        Ok(found.filter(|found| found.record.owner.as_deref() == Some(token)))
    }

    /// Deletes a released object once S3's clock is surely past its token `fence`, if
    /// its ETag is still `etag` (nobody took the key since).
    fn delete_later(&self, object: &Arc<String>, etag: String, fence: u64) {
        let Some(due) = self.clock().surely_past(fence) else {
            return;
        };
        let Some(inner) = self.this.upgrade() else {
            return;
        };
        let object = object.clone();
        tokio::spawn(async move {
            sleep_until(due).await;
            for _ in 0..DELETE_TRIES {
                let cap = Instant::now() + inner.config.command_timeout;
                match inner.delete(&object, &etag, cap).await {
                    // Deleted, or changed or gone meanwhile.
                    Ok(_) => return,
                    Err(error) if !error.transient => return,
                    Err(error) => {
                        tracing::debug!(error = %error.error, "s3 delete after release failed");
                    }
                }
            }
        });
    }
}

/// A delete's or refused write's outcome, with `value` for done.
fn outcome_without<T, U>(outcome: Outcome<T>, value: U) -> Outcome<U> {
    match outcome {
        Outcome::Done(_) => Outcome::Done(value),
        Outcome::Refused => Outcome::Refused,
        Outcome::Gone => Outcome::Gone,
    }
}

impl PolledRecord for Inner {
    type Key = Arc<String>;
    type Held = Held;

    const ENGINE: &'static str = "s3";
    const FIRST_POLL: Duration = Duration::from_millis(10);

    fn settings(&self) -> &Settings {
        &self.config
    }

    fn unanswered(object: &Arc<String>) -> Held {
        Held {
            object: object.clone(),
            granted: None,
            etag: Arc::default(),
        }
    }

    async fn try_grant(
        self: &Arc<Self>,
        object: &Arc<String>,
        in_flight: &mut InFlight<Self>,
        round: Round,
    ) -> Attempt<Granted<Held>> {
        match self.take(object, in_flight, round.limit).await {
            Ok(Taken::Granted {
                record,
                etag,
                sent_at,
            }) => {
                self.watched.forget(object);
                self.clock().saw_token(record.fence);
                let fence = record.fence;
                let held = Held {
                    object: object.clone(),
                    granted: Some(record),
                    etag: Arc::new(Mutex::new(Some(etag))),
                };
                Attempt::Granted(Granted {
                    held,
                    fence,
                    sent_at,
                })
            }
            Ok(Taken::Held { free_by }) => Attempt::Held { free_by },
            Err(error) if error.cut => Attempt::OutOfTime(None),
            // No answer, S3 busy or failing: tried again within the wait.
            Err(error) if error.transient => Attempt::Retry(error.error),
            Err(error) => Attempt::Failed(error.error),
        }
    }

    /// Writes a new record version if `token` still holds the object.
    async fn renew_by(&self, held: &Held, token: &str, cap: Instant) -> Renewal {
        let Some(record) = &held.granted else {
            return Renewal::NotOurs;
        };
        for _ in 0..2 {
            let etag = match held.etag() {
                Some(etag) => etag,
                None => match self.read_ours(&held.object, token, cap).await {
                    Ok(Some(found)) => found.etag,
                    Ok(None) => return Renewal::NotOurs,
                    Err(_) => return Renewal::Unknown,
                },
            };
            // The grant's record again, under a fresh record version: a new ETag.
            match self
                .write(&held.object, record, Condition::Matches(&etag), cap)
                .await
            {
                Ok(Outcome::Done(etag)) => {
                    held.set_etag(Some(etag));
                    return Renewal::Renewed;
                }
                Ok(Outcome::Gone) => return Renewal::NotOurs,
                // Changed since our last answered write: ours still if a write whose
                // answer never came landed; the read tells.
                Ok(Outcome::Refused) => held.set_etag(None),
                Err(_) => {
                    held.set_etag(None);
                    return Renewal::Unknown;
                }
            }
        }
        Renewal::Unknown
    }

    /// One release attempt. The object goes (a delete conditional on this lease's
    /// ETag) once S3's clock is surely past its fencing token: a later object of the
    /// key then starts above it (`ServerClock::token_start`). Until then the record is
    /// rewritten free (`If-Match`), and the object is deleted once the clock is past,
    /// if still unchanged since (`If-Match` on the free record's ETag).
    async fn give_back(&self, held: &Held, token: &str) -> GiveBack {
        let cap = Instant::now() + 2 * self.config.command_timeout;
        for _ in 0..2 {
            let (etag, record) = match (held.etag(), &held.granted) {
                (Some(etag), Some(record)) => (etag, record.clone()),
                _ => match self.read_ours(&held.object, token, cap).await {
                    Ok(Some(found)) => (found.etag, found.record),
                    Ok(None) => return GiveBack::NotOurs,
                    Err(error) => {
                        tracing::debug!(error = %error.error, "s3 lock release failed");
                        return GiveBack::NoAnswer;
                    }
                },
            };
            let released = match self.clock().is_past(record.fence) {
                true => self
                    .delete(&held.object, &etag, cap)
                    .await
                    .map(|outcome| outcome_without(outcome, None)),
                false => {
                    let freed = record.freed();
                    let written = self
                        .write(&held.object, &freed, Condition::Matches(&etag), cap)
                        .await;
                    written.map(|outcome| match outcome {
                        Outcome::Done(etag) => Outcome::Done(Some(etag)),
                        other => outcome_without(other, None),
                    })
                }
            };
            match released {
                Ok(Outcome::Done(free_etag)) => {
                    if let Some(free_etag) = free_etag {
                        self.delete_later(&held.object, free_etag, record.fence);
                    }
                    return GiveBack::Cleared;
                }
                Ok(Outcome::Gone) => return GiveBack::NotOurs,
                // Changed since this lease's last answered write (a renewal whose
                // answer never came may have landed): read who holds it.
                Ok(Outcome::Refused) => held.set_etag(None),
                Err(error) => {
                    held.set_etag(None);
                    tracing::debug!(error = %error.error, "s3 lock release failed");
                    return GiveBack::NoAnswer;
                }
            }
        }
        GiveBack::NoAnswer
    }

    /// `error` inside [`LockError::Backend`], after the engine and its endpoint.
    fn named(&self, error: BoxError) -> LockError {
        LockError::Backend(Box::new(Located::new(
            super::ENGINE,
            self.endpoint.describe().into(),
            error,
        )))
    }

    fn no_answer(&self) -> BoxError {
        Box::new(S3LockError::CommandTimeout(self.config.command_timeout))
    }
}
