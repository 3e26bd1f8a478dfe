//! Redis's steps of the TTL-lease engine: acquire attempts and the waits between them
//! (release messages, the restart guard, `WAIT` for replicas), renewal and give-back as
//! Lua scripts. The life cycle around them is the engine's (`backend::ttl`).

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use redis::{ErrorKind, RedisError, RetryMethod};
use tokio::time::{sleep_until, Instant};

use super::cached::{ACQUIRE, ACQUIRE_COUNTED, RELEASE, RELEASE_COUNTED};
use super::connection::Failure;
use super::eviction::{self, EvictionState};
use super::keys::RedisKeys;
use super::scripts::{RENEW, RENEW_COUNTED};
use super::subscriber::Interest;
use super::Inner;
use crate::backend::ttl::{
    self, fresh_token, jitter, Attempt, Backoff, Contend, GiveBack, InFlight, Renewal, Round,
    Timing, TtlBackend,
};
use crate::backend::{Acquired, LockMode, RetryLater};
use crate::LockError;

/// How often a waiter polls while the subscription is down (capped by `poll_interval`).
const UNSUBSCRIBED_POLL: Duration = Duration::from_millis(50);

/// How long a give-back's mark refuses a late attempt of its token (a lease, if
/// longer), and how long after an unanswered attempt was sent its give-back keeps
/// trying. An attempt run later still grants the key for one lease, as without the
/// mark: a partition that heals, or a server that wakes, within a minute is covered,
/// and the marks, one per give-back that found the key not its own, do not pile up.
const GIVEN_BACK_MARK: Duration = Duration::from_secs(60);

/// Room for a script's numbers, channel and instance id in its command, beyond its
/// keys and tokens (a longer instance id only makes its buffer grow once).
const ARGUMENTS_LEN: usize = 160;

/// The first pause before an attempt that failed is tried again; pauses double up to
/// the command timeout.
const FIRST_RETRY: Duration = Duration::from_millis(20);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whether another attempt may succeed after `error`: a broken or refused connection,
/// an answer out of turn (the connection is replaced), a server loading, read-only
/// or down for a failover. Not a refused authentication, nor an error of the script.
fn is_transient(error: &RedisError) -> bool {
    match error.kind() {
        ErrorKind::AuthenticationFailed => false,
        ErrorKind::UnexpectedReturnType | ErrorKind::Parse | ErrorKind::Io => true,
        _ => !matches!(error.retry_method(), RetryMethod::NoRetry),
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

/// The restart guard refuses grants for `wait` more, longer than the request may wait:
/// a [`RetryLater`], so the client is told why and for how long.
fn restart_guard(lease: Duration, wait: Duration) -> RetryLater {
    let detail = format!(
        "restart guard: the lock server started less than a lease ({lease:?}) and a \
         second ago, and a lock it lost may still be held elsewhere, so it grants none \
         until then; grants resume in {wait:?}"
    );
    RetryLater::new(detail, wait)
}

/// A grant that fewer replicas than asked acknowledged within the wait.
#[derive(Debug)]
struct NotReplicated {
    acknowledged: u32,
    wanted: u32,
}

impl fmt::Display for NotReplicated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "redis grant acknowledged by {} replicas, {} wanted",
            self.acknowledged, self.wanted
        )
    }
}

impl std::error::Error for NotReplicated {}

/// What one acquire script found.
enum Found {
    /// Granted, with a fencing token (none for a reader of a key never written).
    Granted { fence: Option<u64> },
    /// Held by another token, which expires in this many ms (negative: no TTL).
    Held { ttl_ms: i64 },
    /// The server is up for less than a lease: no grant for this many ms.
    Restarted { wait_ms: u64 },
    /// Granted, but acknowledged by too few replicas: to be given back.
    NotReplicated(NotReplicated),
    /// The replay record looked for is stored: nothing was granted.
    Recorded(Vec<u8>),
}

/// One acquisition's state from one attempt to the next.
pub(super) struct Contender {
    /// Its key's release messages, registered before the first attempt, so no release
    /// after it goes unnoticed.
    interest: Interest,
    /// One token for every attempt (a failed attempt aside), armed while an attempt
    /// may have been granted unseen and while a writer waits in the key's intent set
    /// and queue.
    in_flight: InFlight<Inner>,
    /// Whether an attempt of this token was sent: it may be in the intent set.
    token_sent: bool,
    /// Whether the last attempt was answered. One that was not (an error, cut at its
    /// limit) may still have been granted: the next gets a fresh token, and replacing
    /// the `InFlight` gives the old one back.
    answered: bool,
    /// Release messages the key's waiters had had when the last attempt was sent: one
    /// after that may have freed the key.
    releases_seen: u64,
    /// When the last attempt was sent: a grant a release hands on counts from it.
    sent_at: Instant,
    /// When the wait ends: only an attempt sent before it queues for a hand-off (one
    /// that does not wait would be granted the key after it is gone).
    deadline: Instant,
}

impl Inner {
    pub(super) async fn acquire(
        self: Arc<Self>,
        keys: Arc<RedisKeys>,
        wait: Duration,
    ) -> Result<Acquired, LockError> {
        ttl::acquire(&self, &keys, wait).await
    }

    /// Why no lock may be granted now: a server may evict lock keys (and the risk was
    /// not accepted).
    fn eviction_refusal(&self) -> Option<RedisError> {
        if self.config.allow_eviction {
            return None;
        }
        let problem = self.eviction.borrow();
        problem.as_deref().map(eviction::refusal)
    }

    /// Whether a waiter for `keys` takes a grant from a release (see `RELEASE`): a
    /// writer that looks for no replay record (a record stored meanwhile must be
    /// found, not passed over), on a server whose grants need no replica's `WAIT`.
    fn takes_grants(&self, keys: &RedisKeys) -> bool {
        keys.mode == LockMode::Exclusive && keys.record.is_none() && self.config.replicas.is_none()
    }

    /// Logs once per guard period (not per request) that the restart guard refuses
    /// grants, why, for how long, and how tests get around it.
    fn warn_of_restart_guard(&self, wait: Duration) {
        let now = Instant::now();
        let mut until = self
            .guard_warned_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if until.is_some_and(|until| now < until) {
            return;
        }
        *until = Some(now + wait);
        tracing::warn!(
            lease = ?self.config.settings.lease,
            grants_resume_in = ?wait,
            "redis restart guard: the server started less than a lease and a second ago \
             and may have lost locks still held elsewhere, so it grants none until then; \
             requests that cannot wait get 503 with Retry-After. In tests and local \
             development, use a short lease, or RedisBackendBuilder::restart_guard(false) \
             (never in production)"
        );
    }

    async fn attempt_once(
        &self,
        keys: &RedisKeys,
        token: &str,
        sent_before: bool,
        limit: Instant,
        counts: bool,
        queues: bool,
    ) -> Result<Found, Failure> {
        let fence_ttl = self.config.record_ttl_ms(self.config.first_ttl());
        // Outlasts this waiter's longest pause and its next attempt's round trip.
        let waiting_ttl = self.config.settings.poll_interval + self.config.settings.command_timeout;
        let restart_guard = match self.config.restart_guard {
            true => millis(self.config.settings.lease),
            false => 0,
        };
        // Shared and permit holders go through their own script (a sorted set of
        // holders); the exclusive one also waits for the readers and permit holders.
        let (script, holders, permits) = match keys.mode {
            LockMode::Exclusive => (&*ACQUIRE, keys.readers(), None),
            LockMode::Shared => (&*ACQUIRE_COUNTED, keys.readers(), Some(0)),
            LockMode::Permit { of } => (&*ACQUIRE_COUNTED, keys.permits(), Some(of)),
        };
        // By SHA1 (loaded when the backend is built), the command written once: no
        // key or argument is copied on its way.
        // The lock and readers are named twice, the lock again in the given-back mark.
        let bytes =
            2 * keys.names_len() + keys.record.as_ref().map_or(0, String::len) + 3 * token.len();
        let command = script.command(bytes + ARGUMENTS_LEN, |command| {
            command
                .arg(8 + usize::from(keys.record.is_some()))
                .arg(&*keys.lock)
                .arg(keys.holder())
                .arg(keys.waiting())
                .arg(keys.given_back(token))
                .arg(holders)
                .arg(keys.intent())
                .arg(keys.queue())
                .arg(keys.permits());
            if let Some(record) = &keys.record {
                command.arg(record);
            }
            command
                .arg(token)
                .arg(millis(self.config.first_ttl()))
                .arg(fence_ttl)
                .arg(millis(waiting_ttl))
                .arg(restart_guard)
                .arg(&*self.config.settings.instance_id);
            match permits {
                Some(permits) => command.arg(permits),
                None => command.arg(u8::from(sent_before)),
            };
            command.arg(u8::from(queues));
        });
        let replicas = self.config.replicas;
        let (outcome, value, acknowledged) = self
            .commands
            .run(limit, counts, |mut connection| async move {
                let (outcome, value): (i64, redis::Value) =
                    script.run(&command, &mut connection).await?;
                if outcome == 3 {
                    return Ok((outcome, value, None));
                }
                // WAIT on the connection that sent the grant counts its writes.
                let acknowledged = match (outcome, replicas) {
                    (1, Some(replicas)) => Some(replicas.wait(&mut connection).await?),
                    _ => None,
                };
                Ok((outcome, value, acknowledged))
            })
            .await?;
        if outcome == 3 {
            let record = redis::from_redis_value(value).map_err(|e| Failure::Redis(e.into()))?;
            return Ok(Found::Recorded(record));
        }
        let value: i64 = redis::from_redis_value(value).map_err(|e| Failure::Redis(e.into()))?;
        Ok(match outcome {
            1 => match (replicas, acknowledged) {
                (Some(replicas), Some(acknowledged)) if acknowledged < replicas.count => {
                    Found::NotReplicated(NotReplicated {
                        acknowledged,
                        wanted: replicas.count,
                    })
                }
                _ => Found::Granted {
                    fence: u64::try_from(value).ok(),
                },
            },
            2 => Found::Restarted {
                wait_ms: u64::try_from(value).unwrap_or_default(),
            },
            _ => Found::Held { ttl_ms: value },
        })
    }

    /// Extends `token`'s hold on `lock` to `ttl`; whether it still held it. Sent as
    /// `EVAL`, not `EVALSHA`: a server that lost its script cache (a restart, a
    /// failover) would cost a second round trip, and a renewal has none to spare (it
    /// runs once per lease/3, off the request's path).
    async fn renew_once(
        &self,
        keys: &RedisKeys,
        token: &str,
        ttl: Duration,
        limit: Instant,
        counts: bool,
    ) -> Result<bool, Failure> {
        let mut command = redis::cmd("EVAL");
        match keys.holders() {
            // The holder record (with the last fencing token) lives as long as the
            // lock, and the window after it.
            None => command
                .arg(RENEW)
                .arg(2)
                .arg(&*keys.lock)
                .arg(keys.holder())
                .arg(token)
                .arg(millis(ttl))
                .arg(self.config.record_ttl_ms(ttl)),
            Some(holders) => command
                .arg(RENEW_COUNTED)
                .arg(1)
                .arg(holders)
                .arg(token)
                .arg(millis(ttl)),
        };
        let replicas = self.config.replicas;
        self.commands
            .run(limit, counts, |mut connection| async move {
                let renewed: i64 = command.query_async(&mut connection).await?;
                if let (1, Some(replicas)) = (renewed, replicas) {
                    let acknowledged = replicas.wait(&mut connection).await?;
                    if acknowledged < replicas.count {
                        return Err(RedisError::from((
                            redis::ErrorKind::Io,
                            "renewal not acknowledged by enough replicas",
                        )));
                    }
                }
                Ok(renewed == 1)
            })
            .await
    }

    /// One release attempt: if `token` still holds the lock, hands it to the first
    /// queued writer or deletes it, and announces that; if not, takes the token out of
    /// the key's intent and queue and marks it given back, so a late attempt of it
    /// grants nothing. By SHA1 (loaded when the backend is built): the release is on
    /// every lock's path, and a server that lost its script cache costs one round trip
    /// more, once; a release that gets no answer is retried in the background anyway.
    async fn delete_if_ours(&self, keys: &RedisKeys, token: &str) -> GiveBack {
        let mark = millis(GIVEN_BACK_MARK.max(self.config.settings.lease));
        let (script, command) = match keys.holders() {
            None => (
                &*RELEASE,
                RELEASE.command(
                    keys.names_len() + 3 * token.len() + ARGUMENTS_LEN,
                    |command| {
                        command
                            .arg(6)
                            .arg(&*keys.lock)
                            .arg(keys.waiting())
                            .arg(keys.given_back(token))
                            .arg(keys.intent())
                            .arg(keys.queue())
                            .arg(keys.holder());
                    },
                ),
            ),
            Some(holders) => (
                &*RELEASE_COUNTED,
                RELEASE_COUNTED.command(
                    keys.names_len() + 3 * token.len() + ARGUMENTS_LEN,
                    |command| {
                        command
                            .arg(4)
                            .arg(holders)
                            .arg(keys.waiting())
                            .arg(keys.given_back(token))
                            .arg(&*keys.lock);
                    },
                ),
            ),
        };
        let mut command = command;
        command.arg(token).arg(&self.channel).arg(mark);
        let limit = Instant::now() + self.config.settings.command_timeout;
        let release = self.commands.run(limit, true, |mut connection| async move {
            script.run::<i64>(&command, &mut connection).await
        });
        match release.await {
            Ok(1) => GiveBack::Cleared,
            Ok(_) => GiveBack::NotOurs,
            Err(Failure::Redis(error)) => {
                tracing::debug!(%error, "redis lock release failed");
                GiveBack::NoAnswer
            }
            Err(Failure::TimedOut) => {
                tracing::debug!("redis lock release timed out");
                GiveBack::NoAnswer
            }
        }
    }
}

impl Contend for Inner {
    type Key = Arc<RedisKeys>;
    type Grant = Acquired;
    type Contender = Contender;

    fn contender(
        self: &Arc<Self>,
        keys: &Arc<RedisKeys>,
        deadline: Instant,
    ) -> Result<Contender, BoxError> {
        Ok(Contender {
            interest: self.releases.register(&keys.lock),
            in_flight: InFlight::new(self.clone(), keys.clone(), fresh_token()?),
            token_sent: false,
            answered: true,
            releases_seen: 0,
            sent_at: Instant::now(),
            deadline,
        })
    }

    /// A waiter is woken by release messages: the pause is the poll in case one is
    /// missed.
    fn pauses(&self) -> Backoff {
        let poll = self.config.settings.poll_interval;
        Backoff::new(poll, poll)
    }

    fn retry_pauses(&self) -> Backoff {
        let longest = self.config.settings.command_timeout.max(FIRST_RETRY);
        Backoff::new(FIRST_RETRY, longest)
    }

    async fn attempt(
        self: &Arc<Self>,
        contender: &mut Contender,
        keys: &Arc<RedisKeys>,
        round: Round,
    ) -> Attempt<Acquired> {
        // No command of its own: the backend re-reads the policy in the background.
        if let Some(refusal) = self.eviction_refusal() {
            return Attempt::Failed(Box::new(refusal));
        }
        if !contender.answered {
            let token = match fresh_token() {
                Ok(token) => token,
                Err(error) => return Attempt::Failed(Box::new(error)),
            };
            contender.in_flight = InFlight::new(self.clone(), keys.clone(), token);
            contender.token_sent = false;
        }
        let Round { sent_at, limit } = round;
        contender.answered = false;
        contender.releases_seen = contender.interest.releases();
        contender.sent_at = sent_at;
        contender.in_flight.sent(sent_at);
        // Only a whole command timeout says the connection may be silent.
        let counts = limit == sent_at + self.config.settings.command_timeout;
        let queues = sent_at < contender.deadline && self.takes_grants(keys);
        let token = contender.in_flight.token();
        let attempt = self.attempt_once(keys, token, contender.token_sent, limit, counts, queues);
        let found = attempt.await;
        contender.token_sent = true;
        // On an error or timeout `in_flight` stays armed: its drop (or replacement)
        // gives back what the attempt may have been granted.
        let found = match found {
            Ok(found) => found,
            Err(Failure::TimedOut) => return Attempt::OutOfTime(None),
            Err(Failure::Redis(error)) if is_transient(&error) => {
                return Attempt::Retry(Box::new(error))
            }
            Err(Failure::Redis(error)) => return Attempt::Failed(Box::new(error)),
        };
        contender.answered = true;
        match found {
            Found::Granted { fence } => {
                let token = contender.in_flight.granted();
                let lease = ttl::grant(self, keys.clone(), token, fence, sent_at);
                // Each attempt looked for the record (when there is one to look for).
                Attempt::Granted(match keys.record.is_some() {
                    true => Acquired::NotRecorded(lease),
                    false => Acquired::Granted(lease),
                })
            }
            Found::Recorded(record) => {
                contender.in_flight.answered();
                Attempt::Granted(Acquired::Recorded(record))
            }
            Found::Held { ttl_ms } => {
                // A writer refused is in the key's intent set, and may be in its
                // queue: `in_flight` stays armed, so that a writer that stops waiting
                // gives the token back, which takes it out of both, or hands on the
                // key a release granted it meanwhile. Readers and permits enter
                // neither.
                if keys.mode != LockMode::Exclusive {
                    contender.in_flight.answered();
                }
                // One ms past the holder's expiry, the key is free.
                let free_by = u64::try_from(ttl_ms)
                    .ok()
                    .map(|ttl| Instant::now() + Duration::from_millis(ttl + 1));
                Attempt::Held { free_by }
            }
            // `in_flight` stays armed: its drop gives the grant back.
            Found::NotReplicated(error) => Attempt::Failed(Box::new(error)),
            Found::Restarted { wait_ms } => {
                contender.in_flight.answered();
                let wait = Duration::from_millis(wait_ms);
                self.warn_of_restart_guard(wait);
                let refusal = restart_guard(self.config.settings.lease, wait);
                Attempt::HeldBack {
                    until: Instant::now() + wait,
                    refusal: Box::new(refusal),
                }
            }
        }
    }

    /// Woken by a release message, or by a grant a release handed to this waiter.
    async fn wait_for_change(
        self: &Arc<Self>,
        contender: &mut Contender,
        keys: &Arc<RedisKeys>,
        until: Instant,
    ) -> Option<Acquired> {
        // After a failed attempt, a pause as long as asked: that attempt may have run
        // after a grant of its token, or not at all, so a grant announced now has no
        // known start to count the lease from (the token is given back instead).
        if !contender.answered {
            sleep_until(until).await;
            return None;
        }
        let mut until = until;
        // Unsubscribed, release messages go unheard: it looks again sooner.
        if !*self.subscribed.borrow() {
            until = until.min(Instant::now() + jitter(UNSUBSCRIBED_POLL));
        }
        let mut pause = pin!(sleep_until(until));
        let notify = contender.interest.notify.clone();
        loop {
            // Registered before anything is read: a message from now on wakes this
            // registration, one before it is read below.
            let mut released = pin!(notify.notified());
            released.as_mut().enable();
            // A release granted the key to this waiter: its last attempt was refused,
            // so it ran before the grant, and the lease counts from when it was sent.
            if let Some(fence) = contender.interest.take_grant(contender.in_flight.token()) {
                let token = contender.in_flight.granted();
                let lease = ttl::grant(self, keys.clone(), token, Some(fence), contender.sent_at);
                return Some(Acquired::Granted(lease));
            }
            if contender.interest.releases() != contender.releases_seen {
                return None;
            }
            // Only grants to other waiters: the key is held again, and an attempt now
            // would only move this waiter back in the queue. It tries again when the
            // grant's lease would be over, if that is sooner.
            if let Some(granted_until) = contender.interest.granted_until() {
                let retry = granted_until + Duration::from_millis(1);
                if retry < pause.deadline() {
                    pause.as_mut().reset(retry);
                }
            }
            tokio::select! {
                biased;
                () = released => {}
                () = pause.as_mut() => return None,
            }
        }
    }

    /// A writer still queued would be granted the next release, and the key would stay
    /// blocked until a background give-back ran: given back before the timeout is
    /// answered.
    async fn withdraw(&self, mut contender: Contender) {
        contender.in_flight.give_back().await;
    }

    fn named(&self, error: BoxError) -> LockError {
        LockError::Backend(error)
    }

    fn no_answer(&self) -> BoxError {
        Box::new(CommandTimeout(self.config.settings.command_timeout))
    }
}

impl TtlBackend for Inner {
    type Target = Arc<RedisKeys>;

    fn timing(&self) -> Timing {
        self.config.settings.timing().max_hold(self.config.max_hold)
    }

    async fn renew(
        &self,
        keys: &Arc<RedisKeys>,
        token: &str,
        ttl: Duration,
        sent: Instant,
        limit: Instant,
    ) -> Renewal {
        // Only a whole command timeout says the connection may be silent.
        let counts = limit == sent + self.config.settings.command_timeout;
        match self.renew_once(keys, token, ttl, limit, counts).await {
            Ok(true) => Renewal::Renewed,
            Ok(false) => Renewal::NotOurs,
            // Renewed but acknowledged by too few replicas, or no answer.
            Err(_) => Renewal::Unknown,
        }
    }

    /// When a server may evict lock keys (its policy changed since the build), unless
    /// the risk was accepted: an evicted key could be granted to another instance
    /// before a renewal finds it gone. The same for every key (see `gone_for_all`).
    fn gone(&self, _keys: &Arc<RedisKeys>) -> impl Future<Output = ()> + Send {
        evicting(self.eviction.clone(), self.config.allow_eviction)
    }

    async fn try_give_back(&self, keys: &Arc<RedisKeys>, token: &str) -> GiveBack {
        self.delete_if_ours(keys, token).await
    }

    fn engine(&self) -> &'static str {
        "redis"
    }

    fn schedule(&self) -> Option<&ttl::Schedule<Self>> {
        Some(&self.schedule)
    }

    /// Not the grant's expiry: its TTL counts from when Redis runs the attempt, which
    /// a frozen server or a slow path can put off for longer than a lease. Until the
    /// give-back is answered, the attempt may still come; once it is, the attempt was
    /// run before it, or the mark it leaves refuses it.
    fn give_back_until(&self, sent_at: Instant) -> Instant {
        sent_at + GIVEN_BACK_MARK.max(self.config.settings.lease)
    }

    /// At once: a give-back that finds the key not ours marks the token, and the
    /// acquire script grants nothing to a marked token.
    fn settles_at(&self, sent_at: Instant, _answered_at: Instant) -> Instant {
        sent_at
    }
}

/// Resolves once the server may evict lock keys, unless `allowed`; never after the
/// backend is gone (a closed state proves nothing).
async fn evicting(mut state: EvictionState, allowed: bool) {
    if allowed || state.wait_for(Option::is_some).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// What shows every lease of a backend gone at once, for its renewal schedule: the
/// eviction policy is the server's, not a key's.
pub(super) fn gone_for_all(state: &EvictionState, allowed: bool) -> ttl::GoneForAll {
    let state = state.clone();
    Box::new(move || Box::pin(evicting(state.clone(), allowed)))
}

/// Whole milliseconds, at least 1 (Redis rejects a zero `PX`).
pub(super) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}
