//! A lease's life in DynamoDB: acquire attempts and the waits between them (taking over
//! a record that stopped changing), the renewal task, and giving the key back (also when
//! an attempt's answer never came).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};
use tokio::task::AbortHandle;
use tokio::time::{sleep, sleep_until, timeout, timeout_at, Instant};

use super::item::{self, epoch_micros, epoch_seconds, millis, new_token, Holder};
use super::retry::{is_transient, Backoff, CommandTimeout};
use super::Inner;
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, ReleaseLease};
use crate::locks::LockError;

/// The primary key of one lock item.
pub(super) type ItemKey = Arc<HashMap<String, AttributeValue>>;

/// The first pause of a waiter; pauses double from here up to `poll_interval`.
const FIRST_POLL: Duration = Duration::from_millis(5);
/// Backoff of a release retried in the background.
const RELEASE_RETRY_MIN: Duration = Duration::from_millis(50);
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(1);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one acquire attempt found.
enum Attempt {
    Granted {
        fence: u64,
    },
    /// Held by another owner (`None`: it was free again when read).
    Held(Option<Holder>),
}

/// A failed call, whether another attempt may succeed, and whether the write may have
/// been applied all the same.
struct CallError {
    error: BoxError,
    transient: bool,
    maybe_applied: bool,
}

impl From<SdkError<UpdateItemError>> for CallError {
    fn from(error: SdkError<UpdateItemError>) -> Self {
        Self {
            transient: is_transient(&error),
            maybe_applied: !is_refused(&error),
            error: Box::new(aws_sdk_dynamodb::Error::from(error)),
        }
    }
}

impl CallError {
    /// An error of ours, before or without a call: nothing was written.
    fn local(error: BoxError) -> Self {
        Self {
            error,
            transient: false,
            maybe_applied: false,
        }
    }
}

/// Whether DynamoDB answered with a refusal (a 4xx: throttled, invalid, denied): the
/// write was not applied. A 5xx, a timeout or a broken connection leaves it unknown.
fn is_refused(error: &SdkError<UpdateItemError>) -> bool {
    matches!(error, SdkError::ServiceError(service) if service.raw().status().is_client_error())
}

/// How a wait that reached its deadline ends: [`LockError::Timeout`] if the key was
/// held, [`LockError::Backend`] if DynamoDB's last answer was a failure (throttled
/// until the end, failing on its side): the layer then answers 503, not 409.
fn out_of_time(last_failure: Option<BoxError>) -> LockError {
    match last_failure {
        Some(error) => LockError::Backend(error),
        None => LockError::Timeout,
    }
}

/// A random token for one acquisition or record version.
fn fresh_token() -> Result<String, LockError> {
    new_token()
        .map_err(|error| LockError::Backend(Box::new(std::io::Error::other(error.to_string()))))
}

fn is_condition_failed(error: &SdkError<UpdateItemError>) -> bool {
    matches!(
        error.as_service_error(),
        Some(UpdateItemError::ConditionalCheckFailedException(_))
    )
}

impl Inner {
    pub(super) async fn acquire(
        self: Arc<Self>,
        item: ItemKey,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let started = Instant::now();
        let deadline = started
            .checked_add(wait)
            .unwrap_or_else(|| started + Duration::from_secs(86_400 * 365));
        let mut backoff = Backoff::new(FIRST_POLL, self.config.poll_interval);
        // What was seen of the holder is kept in the backend, across acquisitions.
        let id = match item.get(&self.layout.partition_key) {
            Some(AttributeValue::S(value)) => value.clone(),
            _ => String::new(),
        };
        // When the version seen on the key goes stale, if it is held.
        let mut stale_at: Option<Instant> = None;
        // The error of the last attempt, if it failed rather than found the key held.
        let mut last_failure: Option<BoxError> = None;
        let mut first = true;
        loop {
            let sent_at = Instant::now();
            let stale = self.watched.stale_version(&id, sent_at);
            // The first attempt gets a whole command timeout (a zero wait still tries
            // once); later ones end with the wait.
            let limit = match first {
                true => sent_at + self.config.command_timeout,
                false => (sent_at + self.config.command_timeout).min(deadline),
            };
            first = false;
            // Armed until the answer is known: if it never comes (error, timeout, or
            // this future dropped) the write may still have happened, and dropping
            // `in_flight` gives the token's hold back.
            let mut in_flight = InFlight {
                inner: self.clone(),
                item: item.clone(),
                token: fresh_token()?,
                sent_at: Some(sent_at),
            };
            let attempt = self.attempt(&item, &in_flight.token, stale.as_deref());
            match timeout_at(limit, attempt).await {
                Ok(Ok(Attempt::Granted { fence })) => {
                    in_flight.sent_at = None;
                    self.watched.forget(&id);
                    let token = std::mem::take(&mut in_flight.token);
                    return Ok(self.grant(item, token, fence, sent_at));
                }
                Ok(Ok(Attempt::Held(holder))) => {
                    in_flight.sent_at = None;
                    last_failure = None;
                    stale_at = self.watched.saw(&id, holder, Instant::now());
                }
                // Throttled or a failure on DynamoDB's side: try again after a pause.
                Ok(Err(error)) if error.transient => {
                    tracing::debug!(error = %error.error, "dynamodb acquire attempt failed; retrying");
                    if !error.maybe_applied {
                        in_flight.sent_at = None;
                    }
                    last_failure = Some(error.error);
                }
                Ok(Err(error)) => {
                    if !error.maybe_applied {
                        in_flight.sent_at = None;
                    }
                    return Err(LockError::Backend(error.error));
                }
                Err(_) if limit == deadline => return Err(out_of_time(last_failure)),
                Err(_) => {
                    let timeout = CommandTimeout(self.config.command_timeout);
                    return Err(LockError::Backend(Box::new(timeout)));
                }
            }
            drop(in_flight);
            let now = Instant::now();
            if now >= deadline {
                return Err(out_of_time(last_failure));
            }
            let mut pause = backoff.pause().min(deadline - now);
            if let Some(stale_at) = stale_at.filter(|stale_at| now < *stale_at) {
                pause = pause.min(stale_at - now);
            }
            sleep(pause).await;
            if Instant::now() >= deadline {
                return Err(out_of_time(last_failure));
            }
        }
    }

    /// An update of the lock item, with the attribute names every update uses.
    fn update(&self, item: &ItemKey) -> UpdateItemFluentBuilder {
        let layout = &self.layout;
        self.client
            .update_item()
            .table_name(&layout.table)
            .set_key(Some(HashMap::clone(item)))
            .expression_attribute_names("#owner", item::OWNER)
            .expression_attribute_names("#rvn", item::RVN)
            .expression_attribute_names("#lease", item::LEASE_MS)
            .expression_attribute_names("#ttl", &layout.ttl_attribute)
            .expression_attribute_values(":ttl", AttributeValue::N(self.ttl()))
    }

    /// The TTL attribute's value for a write now: generously past the lease.
    fn ttl(&self) -> String {
        epoch_seconds(self.config.lease + self.config.item_ttl)
    }

    /// One conditional write: takes the key if it is free, or if its record version
    /// is still `stale` (a holder that stopped renewing), with a fresh owner token and
    /// the next fencing token.
    async fn attempt(
        &self,
        item: &ItemKey,
        token: &str,
        stale: Option<&str>,
    ) -> Result<Attempt, CallError> {
        let mut update = self
            .update(item)
            .update_expression(
                "SET #owner = :token, #rvn = :rvn, #lease = :lease, #ttl = :ttl, \
                 #fence = if_not_exists(#fence, :seed) + :one",
            )
            .expression_attribute_names("#fence", item::FENCE)
            .expression_attribute_values(":token", AttributeValue::S(token.to_owned()))
            .expression_attribute_values(":rvn", AttributeValue::S(fresh_rvn()?))
            .expression_attribute_values(":lease", AttributeValue::N(millis(self.config.lease)))
            .expression_attribute_values(":seed", AttributeValue::N(epoch_micros()))
            .expression_attribute_values(":one", AttributeValue::N("1".into()))
            .return_values(ReturnValue::UpdatedNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        update = match stale {
            None => update.condition_expression("attribute_not_exists(#owner)"),
            Some(stale) => update
                .condition_expression("attribute_not_exists(#owner) OR #rvn = :stale")
                .expression_attribute_values(":stale", AttributeValue::S(stale.to_owned())),
        };
        match update.send().await {
            Ok(output) => match item::fence(output.attributes()) {
                Some(fence) => Ok(Attempt::Granted { fence }),
                // Applied, but unreadable: give the token back.
                None => Err(CallError {
                    error: "dynamodb returned no fence counter".into(),
                    transient: false,
                    maybe_applied: true,
                }),
            },
            Err(error) if is_condition_failed(&error) => {
                let old = match error.as_service_error() {
                    Some(UpdateItemError::ConditionalCheckFailedException(failed)) => failed.item(),
                    _ => None,
                };
                // `None` also when no old item came back (DynamoDB returns it since
                // 2023): the next attempt then finds out again.
                let holder = old.and_then(|old| Holder::from_item(old, self.config.lease));
                Ok(Attempt::Held(holder))
            }
            Err(error) => Err(error.into()),
        }
    }

    /// A lease for a grant sent at `sent_at`, with its renewal task.
    fn grant(
        self: &Arc<Self>,
        item: ItemKey,
        token: String,
        fence: u64,
        sent_at: Instant,
    ) -> Lease {
        let valid_until = sent_at + self.config.lease.saturating_sub(self.drift);
        let (lost, signal) = LeaseSignal::with_deadline(valid_until);
        let renewal = tokio::spawn(
            self.clone()
                .keep(item.clone(), token.clone(), sent_at, lost),
        );
        let release = DynamoDbRelease {
            inner: self.clone(),
            item,
            token,
            renewal: renewal.abort_handle(),
        };
        Lease::new(Some(fence), signal, release)
    }

    /// Keeps a lease acquired at `acquired_at` alive, and raises `lost` at its local
    /// deadline or at the first answer saying it is not ours. Aborted when the lease is
    /// released or dropped.
    async fn keep(
        self: Arc<Self>,
        item: ItemKey,
        token: String,
        acquired_at: Instant,
        lost: LeaseLostSender,
    ) {
        let lease = self.config.lease;
        let period = lease / 3;
        // Invariant: the key is ours (modulo drift) until `valid_until`: a waiter takes
        // it over only a whole lease after it saw the version written at send time.
        let mut valid_until = acquired_at + lease.saturating_sub(self.drift);
        let mut next = acquired_at + period;
        loop {
            if !self.config.renewal {
                sleep_until(valid_until).await;
                break;
            }
            // The deadline first: once it has passed, the lease is lost even if it is
            // also time to renew.
            tokio::select! {
                biased;
                () = sleep_until(valid_until) => break,
                () = sleep_until(next) => {}
            }
            let sent = Instant::now();
            let limit = (sent + self.config.command_timeout).min(valid_until);
            match timeout_at(limit, self.renew(&item, &token)).await {
                Ok(Ok(true)) => {
                    valid_until = sent + lease.saturating_sub(self.drift);
                    if !lost.extend(valid_until) {
                        break; // the old deadline passed while the answer was on its way
                    }
                    next = sent + period;
                }
                // Definitely not ours any more: released or taken over.
                Ok(Ok(false)) => break,
                // Unknown: try again soon; the deadline stands.
                Ok(Err(_)) | Err(_) => next = Instant::now() + period / 4,
            }
        }
        lost.lose();
    }

    /// Writes a new record version if `token` still holds the key; whether it does.
    async fn renew(&self, item: &ItemKey, token: &str) -> Result<bool, CallError> {
        let renewed = self
            .update(item)
            .update_expression("SET #rvn = :rvn, #lease = :lease, #ttl = :ttl")
            .condition_expression("#owner = :token")
            .expression_attribute_values(":token", AttributeValue::S(token.to_owned()))
            .expression_attribute_values(":rvn", AttributeValue::S(fresh_rvn()?))
            .expression_attribute_values(":lease", AttributeValue::N(millis(self.config.lease)))
            .send()
            .await;
        match renewed {
            Ok(_) => Ok(true),
            Err(error) if is_condition_failed(&error) => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    /// Clears the owner if `token` still holds the key. Returns after one try, bounded
    /// by the command timeout; if that gets no answer, tries again in the background
    /// with backoff until `until` (after which a waiter takes the key over anyway).
    ///
    /// Until `settled`, a write made with `token` may still land: the attempt of a
    /// dropped acquisition can reach the server after its give-back (another
    /// connection, served first). A give-back that finds the key not ours before then
    /// looks again, so such a late grant is cleared too, not left for a takeover.
    async fn give_back(
        self: &Arc<Self>,
        item: ItemKey,
        token: String,
        until: Instant,
        settled: Instant,
    ) {
        let done = move |outcome: GiveBack| match outcome {
            GiveBack::Cleared => true,
            GiveBack::NotOurs => Instant::now() >= settled,
            GiveBack::NoAnswer => false,
        };
        if done(self.try_give_back(&item, &token).await) {
            return;
        }
        let inner = self.clone();
        tokio::spawn(async move {
            let mut backoff = Backoff::new(RELEASE_RETRY_MIN, RELEASE_RETRY_MAX);
            loop {
                let pause = backoff.pause();
                if Instant::now() + pause >= until {
                    break;
                }
                sleep(pause).await;
                if done(inner.try_give_back(&item, &token).await) {
                    return;
                }
            }
            tracing::debug!(
                "dynamodb lock release failed; a waiter takes the key over after a lease"
            );
        });
    }

    /// One release attempt.
    async fn try_give_back(&self, item: &ItemKey, token: &str) -> GiveBack {
        let release = self
            .update(item)
            .update_expression("REMOVE #owner, #rvn, #lease SET #ttl = :ttl")
            .condition_expression("#owner = :token")
            .expression_attribute_values(":token", AttributeValue::S(token.to_owned()))
            .send();
        match timeout(self.config.command_timeout, release).await {
            Ok(Ok(_)) => GiveBack::Cleared,
            Ok(Err(error)) if is_condition_failed(&error) => GiveBack::NotOurs,
            Ok(Err(error)) => {
                let error = aws_sdk_dynamodb::Error::from(error);
                tracing::debug!(%error, "dynamodb lock release failed");
                GiveBack::NoAnswer
            }
            Err(_) => {
                tracing::debug!("dynamodb lock release timed out");
                GiveBack::NoAnswer
            }
        }
    }
}

/// What one give-back attempt found.
enum GiveBack {
    /// The token held the key, and no longer does.
    Cleared,
    /// The token does not hold the key (it never got it, or lost it).
    NotOurs,
    /// DynamoDB did not answer, or failed: the token may still hold the key.
    NoAnswer,
}

fn fresh_rvn() -> Result<String, CallError> {
    new_token()
        .map_err(|error| CallError::local(Box::new(std::io::Error::other(error.to_string()))))
}

/// An acquisition's token, armed while an attempt may have been granted without us
/// knowing: an error, a timeout, or the acquire future dropped mid-attempt. The write
/// may then have happened (or may still happen: a silent server can wake up), so
/// dropping it gives back what the token may hold rather than leave the key blocked.
struct InFlight {
    inner: Arc<Inner>,
    item: ItemKey,
    token: String,
    /// When the attempt in flight was sent; `None` when none is.
    sent_at: Option<Instant>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(sent_at) = self.sent_at else {
            return;
        };
        // Without a runtime (it is shutting down) a waiter takes the key over.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (inner, item) = (self.inner.clone(), self.item.clone());
            let token = std::mem::take(&mut self.token);
            let until = sent_at + inner.config.lease;
            // The attempt was abandoned after a command timeout at most; a server that
            // read it by then has applied it by another one.
            let settled = sent_at + 2 * inner.config.command_timeout;
            runtime.spawn(async move { inner.give_back(item, token, until, settled).await });
        }
    }
}

/// Gives a DynamoDB lease back: stops its renewal, then clears the owner if still ours.
struct DynamoDbRelease {
    inner: Arc<Inner>,
    item: ItemKey,
    token: String,
    renewal: AbortHandle,
}

impl ReleaseLease for DynamoDbRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        self.renewal.abort();
        // No renewal follows, so within a lease any waiter may take the key over.
        let until = Instant::now() + self.inner.config.lease;
        Box::pin(async move {
            let (item, token) = (self.item.clone(), self.token.clone());
            // The grant was answered: no write of this token is still on its way.
            self.inner
                .give_back(item, token, until, Instant::now())
                .await;
        })
    }
}

impl Drop for DynamoDbRelease {
    fn drop(&mut self) {
        // Also when dropped without `release` (no runtime left): renewal stops.
        self.renewal.abort();
    }
}
