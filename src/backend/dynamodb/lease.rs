//! DynamoDB's steps of the TTL-lease engine: acquire attempts and the waits between
//! them (taking over a record that stopped changing), renewal and give-back as
//! conditional writes. The life cycle around them is the engine's (`backend::ttl`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::delete_item::builders::DeleteItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};
use tokio::time::{sleep_until, timeout, timeout_at, Instant};

use super::holder;
use super::item::{self, epoch_seconds, millis, Holder};
use super::retry::{is_transient, CommandTimeout};
use super::Inner;
use crate::backend::located::Located;
use crate::backend::settings::Settings;
use crate::backend::ttl::{
    self, fresh_token, give_back_call, Attempt, GiveBack, Granted, InFlight, PolledRecord, Renewal,
    Round,
};
use crate::LockError;

/// The primary key of one lock item.
pub(super) type ItemKey = Arc<HashMap<String, AttributeValue>>;

/// A lock item as a lease (or an attempt that may have become one) holds it: its key,
/// and the fencing token of the grant (`None` for an attempt whose answer never came).
#[derive(Clone)]
pub(super) struct Held {
    item: ItemKey,
    fence: Option<u64>,
}

/// How many times a deferred delete of a released item is sent while unanswered.
const DELETE_TRIES: u32 = 3;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one conditional write found.
enum Written {
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

fn is_condition_failed(error: &SdkError<UpdateItemError>) -> bool {
    matches!(
        error.as_service_error(),
        Some(UpdateItemError::ConditionalCheckFailedException(_))
    )
}

impl Inner {
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

    /// Where a new item's fence counter starts: the most DynamoDB's clock can read
    /// when this write lands, at the latest two command timeouts after it is sent (a
    /// write unanswered that long is counted as never landing). So it is above the
    /// token of any item deleted before it lands (see [`Self::give_back`]). This
    /// clock before DynamoDB gave a time; and never below a token this process was
    /// granted.
    fn seed(&self) -> String {
        let clock = &self.endpoint.clock;
        clock
            .token_start(self.config.settings.command_timeout)
            .to_string()
    }

    /// The TTL attribute's value for a write now: generously past the lease.
    fn ttl(&self) -> String {
        epoch_seconds(self.config.settings.lease + self.config.item_ttl)
    }

    /// One conditional write: takes the key if it is free, or if its record version
    /// is still `stale` (a holder that stopped renewing), with a fresh owner token and
    /// the next fencing token.
    async fn write_grant(
        &self,
        item: &ItemKey,
        token: &str,
        stale: Option<&str>,
    ) -> Result<Written, CallError> {
        let mut update = self
            .update(item)
            .update_expression(
                "SET #owner = :token, #rvn = :rvn, #lease = :lease, #ttl = :ttl, \
                 #fence = if_not_exists(#fence, :seed) + :one, \
                 #instance = :instance, #since = :since",
            )
            .expression_attribute_names("#fence", item::FENCE)
            .expression_attribute_names("#instance", holder::INSTANCE)
            .expression_attribute_names("#since", holder::SINCE_MS)
            .expression_attribute_values(
                ":instance",
                AttributeValue::S(self.config.settings.instance_id.to_string()),
            )
            .expression_attribute_values(":since", AttributeValue::N(holder::since_now()))
            .expression_attribute_values(":token", AttributeValue::S(token.to_owned()))
            .expression_attribute_values(":rvn", AttributeValue::S(fresh_rvn()?))
            .expression_attribute_values(
                ":lease",
                AttributeValue::N(millis(self.config.settings.lease)),
            )
            .expression_attribute_values(":seed", AttributeValue::N(self.seed()))
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
                Some(fence) => Ok(Written::Granted { fence }),
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
                let holder = old.and_then(|old| Holder::from_item(old, self.config.settings.lease));
                Ok(Written::Held(holder))
            }
            Err(error) => Err(error.into()),
        }
    }

    /// Writes a new record version if `token` still holds the key; whether it does.
    async fn write_new_version(&self, item: &ItemKey, token: &str) -> Result<bool, CallError> {
        let renewed = self
            .update(item)
            .update_expression("SET #rvn = :rvn, #lease = :lease, #ttl = :ttl")
            .condition_expression("#owner = :token")
            .expression_attribute_values(":token", AttributeValue::S(token.to_owned()))
            .expression_attribute_values(":rvn", AttributeValue::S(fresh_rvn()?))
            .expression_attribute_values(
                ":lease",
                AttributeValue::N(millis(self.config.settings.lease)),
            )
            .send()
            .await;
        match renewed {
            Ok(_) => Ok(true),
            Err(error) if is_condition_failed(&error) => Ok(false),
            Err(error) => Err(error.into()),
        }
    }

    /// Deletes the item if `token` holds it.
    async fn delete_held(&self, item: &ItemKey, token: &str) -> GiveBack {
        let delete = delete(&self.client, &self.layout.table, item)
            .condition_expression("#owner = :token")
            .expression_attribute_values(":token", AttributeValue::S(token.to_owned()))
            .send();
        self.give_back_by("dynamodb lock delete", delete).await
    }

    /// One release attempt: clears the owner if `token` still holds the key.
    async fn clear_owner(&self, item: &ItemKey, token: &str) -> GiveBack {
        let release = self
            .update(item)
            .update_expression("REMOVE #owner, #rvn, #lease SET #ttl = :ttl")
            .condition_expression("#owner = :token")
            .expression_attribute_values(":token", AttributeValue::S(token.to_owned()))
            .send();
        self.give_back_by("dynamodb lock release", release).await
    }

    /// A give-back by one write conditional on the owner token, bounded by the command
    /// timeout: not ours when its condition failed, no answer on any other error.
    async fn give_back_by<T, E>(
        &self,
        what: &str,
        write: impl Future<Output = Result<T, SdkError<E>>>,
    ) -> GiveBack
    where
        aws_sdk_dynamodb::Error: From<SdkError<E>>,
    {
        let write = async { write.await.map_err(aws_sdk_dynamodb::Error::from) };
        let limit = self.config.settings.command_timeout;
        give_back_call(what, limit, write, |error| {
            matches!(
                error,
                aws_sdk_dynamodb::Error::ConditionalCheckFailedException(_)
            )
        })
        .await
    }
}

/// A delete of the lock item `item`.
fn delete(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
    item: &ItemKey,
) -> DeleteItemFluentBuilder {
    client
        .delete_item()
        .table_name(table)
        .set_key(Some(HashMap::clone(item)))
        .expression_attribute_names("#owner", item::OWNER)
}

/// What a delete after a release needs, apart from the backend.
struct Deleter {
    client: aws_sdk_dynamodb::Client,
    table: String,
    endpoint: Arc<super::table::Endpoint>,
    command_timeout: Duration,
}

impl Deleter {
    /// Deletes a released item at `due`, when DynamoDB's clock is surely past its
    /// fence, on the condition that nobody holds it and its fence is below that clock
    /// still (a key granted again meanwhile keeps its item until its own release).
    /// Sent again while unanswered, up to [`DELETE_TRIES`] times; an item left behind
    /// goes with the table's TTL.
    async fn delete_released(self, item: ItemKey, due: Instant) {
        sleep_until(due).await;
        for _ in 0..DELETE_TRIES {
            let Some(now) = self.endpoint.clock.at_least(Instant::now()) else {
                return;
            };
            let delete = delete(&self.client, &self.table, &item)
                .condition_expression("attribute_not_exists(#owner) AND #fence < :now")
                .expression_attribute_names("#fence", item::FENCE)
                .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
                .send();
            match timeout(self.command_timeout, delete).await {
                Ok(Ok(_)) => return,
                // Nothing to delete, or refused for good (sent again: throttling, a
                // failure on DynamoDB's side).
                Ok(Err(error)) if !is_transient(&error) => return,
                Ok(Err(error)) => {
                    let error = aws_sdk_dynamodb::Error::from(error);
                    tracing::debug!(%error, "dynamodb delete of a released item failed");
                }
                Err(_) => tracing::debug!("dynamodb delete of a released item timed out"),
            }
        }
    }
}

fn fresh_rvn() -> Result<String, CallError> {
    fresh_token().map_err(|error| match error {
        LockError::Backend(error) => CallError::local(error),
        other => CallError::local(Box::new(other)),
    })
}

impl PolledRecord for Inner {
    type Key = ItemKey;
    type Held = Held;

    const ENGINE: &'static str = "dynamodb";
    const FIRST_POLL: Duration = Duration::from_millis(5);

    fn settings(&self) -> &Settings {
        &self.config.settings
    }

    fn unanswered(item: &ItemKey) -> Held {
        Held {
            item: item.clone(),
            fence: None,
        }
    }

    /// Takes the key if it is free, or over a holder whose record stopped changing for
    /// a lease as this process saw it (what was seen is kept across acquisitions).
    async fn try_grant(
        self: &Arc<Self>,
        item: &ItemKey,
        in_flight: &mut InFlight<Self>,
        round: Round,
    ) -> Attempt<Granted<Held>> {
        let sent_at = round.sent_at;
        let id = match item.get(&self.layout.partition_key) {
            Some(AttributeValue::S(value)) => value.clone(),
            _ => String::new(),
        };
        let stale = self.watched.stale_version(&id, sent_at);
        in_flight.sent(sent_at);
        match self
            .write_grant(item, in_flight.token(), stale.as_deref())
            .await
        {
            Ok(Written::Granted { fence }) => {
                self.watched.forget(&id);
                self.endpoint.clock.saw_token(fence);
                let held = Held {
                    item: item.clone(),
                    fence: Some(fence),
                };
                Attempt::Granted(Granted {
                    held,
                    fence,
                    sent_at,
                })
            }
            Ok(Written::Held(holder)) => {
                in_flight.answered();
                let version = holder.map(|holder| ttl::Version {
                    version: holder.rvn,
                    lease: holder.lease,
                });
                let free_by = self.watched.saw(&id, version, Instant::now());
                Attempt::Held { free_by }
            }
            // Throttled, a failure on DynamoDB's side, or no answer (the endpoint
            // unreachable, the connection broken): tried again after a pause.
            Err(error) => {
                if !error.maybe_applied {
                    in_flight.answered();
                }
                match error.transient {
                    true => Attempt::Retry(error.error),
                    false => Attempt::Failed(error.error),
                }
            }
        }
    }

    async fn renew_by(&self, held: &Held, token: &str, limit: Instant) -> Renewal {
        match timeout_at(limit, self.write_new_version(&held.item, token)).await {
            Ok(Ok(true)) => Renewal::Renewed,
            Ok(Ok(false)) => Renewal::NotOurs,
            Ok(Err(_)) | Err(_) => Renewal::Unknown,
        }
    }

    /// One release attempt. The item goes with the lease once DynamoDB's clock is
    /// surely past its fence counter: a later item of the key then starts above it
    /// ([`Self::seed`]). Until then the owner is cleared and the item is deleted once
    /// the clock is past, if nobody holds it by then.
    async fn give_back(&self, held: &Held, token: &str) -> GiveBack {
        let clock = &self.endpoint.clock;
        if held.fence.is_some_and(|fence| clock.is_past(fence)) {
            return self.delete_held(&held.item, token).await;
        }
        let cleared = self.clear_owner(&held.item, token).await;
        if !matches!(cleared, GiveBack::NoAnswer) {
            // An attempt's item (fence unknown) has a fence below this at most.
            let fence = held
                .fence
                .or_else(|| clock.at_most_on_landing(self.config.settings.command_timeout));
            if let Some(due) = fence.and_then(|fence| clock.surely_past(fence)) {
                let deleter = Deleter {
                    client: self.client.clone(),
                    table: self.layout.table.clone(),
                    endpoint: self.endpoint.clone(),
                    command_timeout: self.config.settings.command_timeout,
                };
                tokio::spawn(deleter.delete_released(held.item.clone(), due));
            }
        }
        cleared
    }

    /// `error` inside [`LockError::Backend`], after the engine and its endpoint.
    fn named(&self, error: BoxError) -> LockError {
        LockError::Backend(Box::new(Located::new(
            super::table::ENGINE,
            self.endpoint.describe().into(),
            error,
        )))
    }

    fn no_answer(&self) -> BoxError {
        Box::new(CommandTimeout(self.config.settings.command_timeout))
    }
}
