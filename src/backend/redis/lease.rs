//! A lease's life in Redis: acquire attempts and the waits between them, the renewal
//! task, and giving the lock back (also when an attempt's answer never came).

use std::fmt;
use std::pin::pin;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use redis::RedisError;
use tokio::task::AbortHandle;
use tokio::time::{sleep, sleep_until, Instant};

use super::connection::Failure;
use super::keys::{new_token, RedisKeys};
use super::{jitter, Inner, RESUBSCRIBE_MAX, RESUBSCRIBE_MIN};
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, ReleaseLease, RetryLater};
use crate::locks::LockError;

/// How often a waiter polls while the subscription is down (capped by `poll_interval`).
const UNSUBSCRIBED_POLL: Duration = Duration::from_millis(50);

/// How long a give-back's mark refuses a late attempt of its token (a lease, if
/// longer), and how long after an unanswered attempt was sent its give-back keeps
/// trying. An attempt run later still grants the key for one lease, as without the
/// mark: a partition that heals, or a server that wakes, within a minute is covered,
/// and the marks, one per give-back that found the key not its own, do not pile up.
const GIVEN_BACK_MARK: Duration = Duration::from_secs(60);

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

/// What one acquire attempt found.
enum Attempt {
    Granted {
        fence: u64,
    },
    /// Held by another token, which expires in this many ms (negative: no TTL).
    Held {
        ttl_ms: i64,
    },
    /// The server is up for less than a lease: no grant for this many ms.
    Restarted {
        wait_ms: u64,
    },
    /// Granted, but acknowledged by too few replicas: to be given back.
    NotReplicated(NotReplicated),
}

/// A random token for one acquisition.
fn fresh_token() -> Result<String, LockError> {
    new_token()
        .map_err(|error| LockError::Backend(Box::new(std::io::Error::other(error.to_string()))))
}

impl Inner {
    pub(super) async fn acquire(
        self: Arc<Self>,
        keys: Arc<RedisKeys>,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let started = Instant::now();
        let deadline = started
            .checked_add(wait)
            .unwrap_or_else(|| started + Duration::from_secs(86_400 * 365));
        let token = fresh_token()?;
        // Registered before the first attempt, so no release after it goes unnoticed.
        let interest = self.releases.register(&keys.lock);
        let mut in_flight = InFlight {
            inner: self.clone(),
            keys,
            token,
            sent_at: None,
        };
        let mut first = true;
        let mut reconnected = false;
        loop {
            let mut released = pin!(interest.notify.notified());
            released.as_mut().enable();

            let sent_at = Instant::now();
            // The first attempt gets a whole command timeout (a zero wait still tries
            // once); later ones end with the wait.
            let limit = match first {
                true => sent_at + self.config.command_timeout,
                false => (sent_at + self.config.command_timeout).min(deadline),
            };
            first = false;
            in_flight.sent_at = Some(sent_at);
            // Only a whole command timeout says the connection may be silent.
            let counts = limit == sent_at + self.config.command_timeout;
            let attempt = self.attempt(&in_flight.keys, &in_flight.token, limit, counts);
            // On an error or timeout `in_flight` stays armed: its drop gives back what
            // the attempt may have been granted.
            let ttl_ms = match attempt.await {
                Ok(Attempt::Granted { fence }) => {
                    in_flight.sent_at = None;
                    let (keys, token) = (in_flight.keys.clone(), in_flight.token.clone());
                    return Ok(self.grant(keys, token, fence, sent_at));
                }
                Ok(Attempt::Held { ttl_ms }) => ttl_ms,
                // `in_flight` stays armed: its drop gives the grant back.
                Ok(Attempt::NotReplicated(error)) => {
                    return Err(LockError::Backend(Box::new(error)))
                }
                Ok(Attempt::Restarted { wait_ms }) => {
                    in_flight.sent_at = None;
                    let wait = Duration::from_millis(wait_ms);
                    self.warn_of_restart_guard(wait);
                    if Instant::now() + wait >= deadline {
                        let guard = restart_guard(self.config.lease, wait);
                        return Err(LockError::Backend(Box::new(guard)));
                    }
                    sleep(wait).await;
                    continue;
                }
                Err(Failure::Redis(error))
                    if !reconnected
                        && error.is_connection_dropped()
                        && Instant::now() < deadline =>
                {
                    // The connection died under this attempt (Redis restarted, a
                    // failover): the manager reconnects on the next command, so try
                    // once more rather than fail a request Redis could serve. The lost
                    // attempt may still have been granted: dropping its `InFlight`
                    // gives that token back, and the retry uses a fresh one.
                    reconnected = true;
                    let keys = in_flight.keys.clone();
                    in_flight = InFlight {
                        inner: self.clone(),
                        keys,
                        token: fresh_token()?,
                        sent_at: None,
                    };
                    continue;
                }
                Err(Failure::Redis(error)) => return Err(LockError::Backend(Box::new(error))),
                Err(Failure::TimedOut) if limit == deadline => return Err(LockError::Timeout),
                Err(Failure::TimedOut) => {
                    let timeout = CommandTimeout(self.config.command_timeout);
                    return Err(LockError::Backend(Box::new(timeout)));
                }
            };
            in_flight.sent_at = None;
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout);
            }
            let pause = self.pause(ttl_ms).min(deadline - now);
            // Woken by a release message or the end of the pause, whichever is first.
            tokio::select! {
                biased;
                () = released => {}
                () = sleep(pause) => {}
            }
            if Instant::now() >= deadline {
                return Err(LockError::Timeout);
            }
        }
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
            lease = ?self.config.lease,
            grants_resume_in = ?wait,
            "redis restart guard: the server started less than a lease and a second ago \
             and may have lost locks still held elsewhere, so it grants none until then; \
             requests that cannot wait get 503 with Retry-After. In tests and local \
             development, use a short lease, or RedisBackendBuilder::restart_guard(false) \
             (never in production)"
        );
    }

    /// How long to wait for a release message before trying again.
    fn pause(&self, holder_ttl_ms: i64) -> Duration {
        let mut poll = self.config.poll_interval;
        if !*self.subscribed.borrow() {
            poll = poll.min(UNSUBSCRIBED_POLL);
        }
        let pause = jitter(poll);
        match u64::try_from(holder_ttl_ms) {
            // One ms past the holder's expiry, the key is free.
            Ok(ttl) => pause.min(Duration::from_millis(ttl + 1)),
            Err(_) => pause,
        }
    }

    async fn attempt(
        &self,
        keys: &RedisKeys,
        token: &str,
        limit: Instant,
        counts: bool,
    ) -> Result<Attempt, Failure> {
        let fence_ttl = self
            .config
            .fence_ttl
            .map_or(0, |ttl| millis(ttl.max(self.config.lease)));
        // Outlasts this waiter's longest pause and its next attempt's round trip.
        let waiting_ttl = self.config.poll_interval + self.config.command_timeout;
        let restart_guard = match self.config.restart_guard {
            true => millis(self.config.lease),
            false => 0,
        };
        let mut invocation = self.acquire.key(&*keys.lock);
        invocation
            .key(&keys.fence)
            .key(&keys.waiting)
            .key(keys.given_back(token))
            .arg(token)
            .arg(millis(self.config.first_ttl()))
            .arg(fence_ttl)
            .arg(millis(waiting_ttl))
            .arg(restart_guard);
        let replicas = self.config.replicas;
        let (outcome, value, acknowledged) = self
            .commands
            .run(limit, counts, |mut connection| async move {
                let (outcome, value): (i64, i64) = invocation.invoke_async(&mut connection).await?;
                // WAIT on the connection that sent the grant counts its writes.
                let acknowledged = match (outcome, replicas) {
                    (1, Some(replicas)) => Some(replicas.wait(&mut connection).await?),
                    _ => None,
                };
                Ok((outcome, value, acknowledged))
            })
            .await?;
        Ok(match outcome {
            1 => match (replicas, acknowledged) {
                (Some(replicas), Some(acknowledged)) if acknowledged < replicas.count => {
                    Attempt::NotReplicated(NotReplicated {
                        acknowledged,
                        wanted: replicas.count,
                    })
                }
                _ => Attempt::Granted {
                    fence: u64::try_from(value).unwrap_or_default(),
                },
            },
            2 => Attempt::Restarted {
                wait_ms: u64::try_from(value).unwrap_or_default(),
            },
            _ => Attempt::Held { ttl_ms: value },
        })
    }

    /// A lease for a grant sent at `sent_at`, with its renewal task.
    fn grant(
        self: &Arc<Self>,
        keys: Arc<RedisKeys>,
        token: String,
        fence: u64,
        sent_at: Instant,
    ) -> Lease {
        let valid_until = sent_at + self.config.first_ttl().saturating_sub(self.drift);
        let (lost, signal) = LeaseSignal::with_deadline(valid_until);
        let renewal =
            tokio::spawn(
                self.clone()
                    .keep(keys.lock.clone(), token.clone(), sent_at, lost),
            );
        let release = RedisRelease {
            inner: self.clone(),
            keys,
            token,
            renewal: renewal.abort_handle(),
        };
        Lease::new(Some(fence), signal, release)
    }

    /// Keeps a lease acquired at `acquired_at` alive, and raises `lost` at its local
    /// deadline or at the first reply saying it is not ours. Aborted when the lease is
    /// released or dropped.
    async fn keep(
        self: Arc<Self>,
        lock: Arc<str>,
        token: String,
        acquired_at: Instant,
        lost: LeaseLostSender,
    ) {
        let config = &self.config;
        let period = config.lease / 3;
        let hold_end = config.max_hold.map(|max| acquired_at + max);
        // Invariant: the lease is valid (ours in Redis, modulo drift) until `valid_until`.
        let mut valid_until = acquired_at + config.first_ttl().saturating_sub(self.drift);
        let mut next = acquired_at + period;
        loop {
            let renew = config.renewal && hold_end.is_none_or(|end| next < end);
            if !renew {
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
            let ttl = hold_end
                .map_or(config.lease, |end| {
                    config.lease.min(end.saturating_duration_since(sent))
                })
                .max(Duration::from_millis(1));
            let full = sent + config.command_timeout;
            let limit = full.min(valid_until);
            match self.renew(&lock, &token, ttl, limit, limit == full).await {
                Ok(true) => {
                    valid_until = sent + ttl.saturating_sub(self.drift);
                    if !lost.extend(valid_until) {
                        break; // the old deadline passed while the answer was on its way
                    }
                    next = sent + period;
                }
                // Definitely not ours any more: deleted, expired or taken over.
                Ok(false) => break,
                // Renewed, but acknowledged by too few replicas, or unknown: try again
                // soon; the deadline stands.
                Err(_) => next = Instant::now() + period / 4,
            }
        }
        lost.lose();
    }

    async fn renew(
        &self,
        lock: &str,
        token: &str,
        ttl: Duration,
        limit: Instant,
        counts: bool,
    ) -> Result<bool, Failure> {
        let mut invocation = self.renew.key(lock);
        invocation.arg(token).arg(millis(ttl));
        let replicas = self.config.replicas;
        self.commands
            .run(limit, counts, |mut connection| async move {
                let renewed: i64 = invocation.invoke_async(&mut connection).await?;
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

    /// Deletes the lock if `token` still holds it and announces the release. Returns
    /// after one try, bounded by the command timeout; if that gets no answer, tries
    /// again in the background until Redis answers or `until` (past it, the key is
    /// gone by itself, or cannot be helped any more). A pause between tries lasts at
    /// most a quarter of the lease: a key granted to this token while nobody holds it
    /// is freed soon after Redis answers again, not a lease later.
    async fn give_back(self: &Arc<Self>, keys: Arc<RedisKeys>, token: String, until: Instant) {
        if self.try_give_back(&keys, &token).await {
            return;
        }
        let inner = self.clone();
        tokio::spawn(async move {
            let longest = (inner.config.lease / 4).clamp(RESUBSCRIBE_MIN, RESUBSCRIBE_MAX);
            let mut backoff = RESUBSCRIBE_MIN;
            loop {
                let pause = jitter(backoff);
                if Instant::now() + pause >= until {
                    break;
                }
                sleep(pause).await;
                if inner.try_give_back(&keys, &token).await {
                    return;
                }
                backoff = (backoff * 2).min(longest);
            }
            tracing::debug!("redis lock release unanswered; giving up on it");
        });
    }

    /// One release attempt; whether Redis answered.
    async fn try_give_back(&self, keys: &RedisKeys, token: &str) -> bool {
        let mut invocation = self.release.key(&*keys.lock);
        invocation
            .key(&keys.waiting)
            .key(keys.given_back(token))
            .arg(token)
            .arg(&self.channel)
            .arg(millis(GIVEN_BACK_MARK.max(self.config.lease)));
        let limit = Instant::now() + self.config.command_timeout;
        let release = self.commands.run(limit, true, |mut connection| async move {
            invocation.invoke_async::<i64>(&mut connection).await
        });
        match release.await {
            Ok(_) => true,
            Err(Failure::Redis(error)) => {
                tracing::debug!(%error, "redis lock release failed");
                false
            }
            Err(Failure::TimedOut) => {
                tracing::debug!("redis lock release timed out");
                false
            }
        }
    }
}

/// An acquisition's token, armed while an attempt may have been granted without us
/// knowing: an error, a timeout, or the acquire future dropped mid-attempt. Then the
/// script may have run (or may still run: a silent server can wake up), so dropping
/// it gives back what the token may hold rather than leave the key blocked for a lease.
struct InFlight {
    inner: Arc<Inner>,
    keys: Arc<RedisKeys>,
    token: String,
    /// When the attempt in flight was sent; `None` when none is.
    sent_at: Option<Instant>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(sent_at) = self.sent_at else {
            return;
        };
        // Without a runtime (it is shutting down) the key expires by its lease.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (inner, keys) = (self.inner.clone(), self.keys.clone());
            let token = std::mem::take(&mut self.token);
            // Not `sent_at` + lease: the grant's TTL counts from when Redis runs the
            // attempt, which a frozen server or a slow path can put off for longer
            // than a lease. Until the give-back is answered, it may still come; once it
            // is, the attempt was run before it, or the mark it leaves refuses it.
            let until = sent_at + GIVEN_BACK_MARK.max(inner.config.lease);
            runtime.spawn(async move { inner.give_back(keys, token, until).await });
        }
    }
}

/// Gives a Redis lease back: stops its renewal, then deletes the key if still ours.
struct RedisRelease {
    inner: Arc<Inner>,
    keys: Arc<RedisKeys>,
    token: String,
    renewal: AbortHandle,
}

impl ReleaseLease for RedisRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        self.renewal.abort();
        // No renewal can follow, so the key is gone from Redis within one lease.
        let expires = Instant::now() + self.inner.config.lease;
        Box::pin(async move {
            let (keys, token) = (self.keys.clone(), self.token.clone());
            self.inner.give_back(keys, token, expires).await;
        })
    }
}

impl Drop for RedisRelease {
    fn drop(&mut self) {
        // Also when dropped without `release` (no runtime left): renewal stops.
        self.renewal.abort();
    }
}

/// Whole milliseconds, at least 1 (Redis rejects a zero `PX`).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}
