//! The engines whose lock is one record (a DynamoDB item, an S3 object, an Azure blob)
//! taken by a conditional write, and that waiters poll: their side of the acquire loop
//! and of the life cycle, written once. Each brings its attempt, renewal and give-back
//! ([`PolledRecord`]); the token, the attempt's in-flight guard, the grant and the
//! pauses between polls are the same for all of them.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    fresh_token, grant, Attempt, Backoff, Contend, GiveBack, InFlight, Renewal, Round, Timing,
    TtlBackend,
};
use crate::backend::settings::Settings;
use crate::backend::Lease;
use crate::LockError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A grant as an attempt wrote it.
pub(crate) struct Granted<H> {
    /// The record as the lease holds it.
    pub(crate) held: H,
    /// The fencing token written.
    pub(crate) fence: u64,
    /// When the granting write was sent: the lease's validity counts from then.
    pub(crate) sent_at: Instant,
}

/// An engine whose lock is one record taken by a conditional write, polled by waiters:
/// its steps. Its [`Contend`] and [`TtlBackend`] come from these.
pub(crate) trait PolledRecord: Send + Sync + Sized + 'static {
    /// What one acquisition contends for (an item's key, an object's name, a blob).
    type Key: Send + Sync;
    /// A record as a lease (or an attempt that may have become one) holds it.
    type Held: Clone + Send + Sync + 'static;

    /// The engine's name in logs ("dynamodb").
    const ENGINE: &'static str;
    /// The first pause of a waiter; pauses double from here up to the poll interval.
    const FIRST_POLL: Duration;

    /// The backend's settings: the timing of its leases and its poll interval.
    fn settings(&self) -> &Settings;

    /// `key` as the in-flight guard of an attempt holds it, before any grant.
    fn unanswered(key: &Self::Key) -> Self::Held;

    /// An attempt's token, made of a fresh random one; as it is by default.
    fn token(fresh: String) -> String {
        fresh
    }

    /// One attempt on `key` for `in_flight`'s token, whose calls end by the round's
    /// limit. `in_flight` is armed (by the attempt) while a write that may grant is
    /// unanswered, and disarmed once its answer granted nothing.
    fn try_grant(
        self: &Arc<Self>,
        key: &Self::Key,
        in_flight: &mut InFlight<Self>,
        round: Round,
    ) -> impl Future<Output = Attempt<Granted<Self::Held>>> + Send;

    /// Extends `token`'s hold on `held` by a lease; answered by `limit`, or
    /// [`Renewal::Unknown`].
    fn renew_by(
        &self,
        held: &Self::Held,
        token: &str,
        limit: Instant,
    ) -> impl Future<Output = Renewal> + Send;

    /// One release attempt: frees the record if `token` holds it.
    fn give_back(&self, held: &Self::Held, token: &str) -> impl Future<Output = GiveBack> + Send;

    /// `error` inside [`LockError::Backend`], after the engine and where it is.
    fn named(&self, error: BoxError) -> LockError;

    /// The engine's error for a call unanswered within the command timeout.
    fn no_answer(&self) -> BoxError;
}

impl<E: PolledRecord> Contend for E {
    type Key = E::Key;
    type Grant = Lease;
    type Contender = ();

    fn contender(self: &Arc<Self>, _: &E::Key, _: Instant) -> Result<(), BoxError> {
        Ok(())
    }

    fn pauses(&self) -> Backoff {
        Backoff::new(E::FIRST_POLL, self.settings().poll_interval)
    }

    async fn attempt(self: &Arc<Self>, _: &mut (), key: &E::Key, round: Round) -> Attempt {
        let token = match fresh_token() {
            Ok(token) => E::token(token),
            Err(error) => return Attempt::Failed(Box::new(error)),
        };
        // Armed while a write that may grant is unanswered: dropping it (an error, the
        // wait over, this future dropped) gives back what the token may hold.
        let mut in_flight = InFlight::new(self.clone(), E::unanswered(key), token);
        let attempt = self.try_grant(key, &mut in_flight, round).await;
        attempt.map_grant(|granted| {
            let token = in_flight.granted();
            grant(
                self,
                granted.held,
                token,
                Some(granted.fence),
                granted.sent_at,
            )
        })
    }

    fn named(&self, error: BoxError) -> LockError {
        PolledRecord::named(self, error)
    }

    fn no_answer(&self) -> BoxError {
        PolledRecord::no_answer(self)
    }
}

impl<E: PolledRecord> TtlBackend for E {
    type Target = E::Held;

    fn timing(&self) -> Timing {
        self.settings().timing()
    }

    async fn renew(
        &self,
        held: &E::Held,
        token: &str,
        _ttl: Duration,
        _sent: Instant,
        limit: Instant,
    ) -> Renewal {
        self.renew_by(held, token, limit).await
    }

    async fn try_give_back(&self, held: &E::Held, token: &str) -> GiveBack {
        self.give_back(held, token).await
    }

    fn engine(&self) -> &'static str {
        E::ENGINE
    }
}
