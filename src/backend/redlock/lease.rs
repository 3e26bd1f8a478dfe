//! Redlock's steps of the TTL-lease engine: an attempt on every master at once that
//! counts when a majority granted within the validity budget, renewal that must reach a
//! majority, give-back on every master. The life cycle around them (the acquire loop,
//! validity deadline, renewal every lease/3, background give-back, the in-flight guard)
//! is the engine's (`backend::ttl`).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{timeout_at, Instant};

use super::master::{give_up, Reply, Vote};
use super::quorum::{ask_all, failed_masters, majority, Replies, Votes};
use super::Inner;
use crate::backend::redis::keys::RedisKeys;
use crate::backend::ttl::{
    self, fresh_token, Attempt, Backoff, Contend, GiveBack, InFlight, Renewal, Round, Timing,
    TtlBackend,
};
use crate::backend::{Lease, RetryLater};
use crate::LockError;

/// The first pause between attempts on a held key; it doubles up to the poll interval.
const FIRST_RETRY: Duration = Duration::from_millis(5);

/// How long a give-back's mark refuses a late attempt of its token on a master, and
/// how long after an unanswered attempt its give-back keeps trying: as long as the
/// network can still deliver the attempt (the masters' connections give up on data
/// unacknowledged for [`give_up`], and the socket's unsent data goes with it), within
/// one lease and ten.
///
/// What the mark protects: an attempt that reaches a master after its token was given
/// back would grant that master's vote to a token nobody waits for. That breaks no
/// exclusion (its acquirer counted nothing), but the master votes for no one else for
/// a lease; the other masters still make a majority. A master frozen with the attempt
/// already in its socket runs it whenever it wakes, later than any mark could last: it
/// then costs that vote for a lease, as it would after a mark of any length. Bounded
/// so, a released key leaves nothing on a master after at most ten leases.
fn given_back_mark(config: &super::Config) -> Duration {
    give_up(config.settings.command_timeout)
        .clamp(config.settings.lease, config.settings.lease * 10)
}

/// Too few masters answered for any majority: which did not, and why.
#[derive(Debug)]
pub(super) struct NoMajority {
    pub(super) answered: usize,
    pub(super) masters: usize,
    /// `(host:port, cause)` of every master that gave no answer.
    pub(super) failed: Vec<(String, String)>,
}

impl fmt::Display for NoMajority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Redlock: {} of {} Redis masters answered in time, {} needed for a majority",
            self.answered,
            self.masters,
            majority(self.masters)
        )?;
        if !self.failed.is_empty() {
            write!(f, "; no answer from {}", failed_masters(&self.failed))?;
        }
        Ok(())
    }
}

impl std::error::Error for NoMajority {}

impl Contend for Inner {
    type Key = Arc<RedisKeys>;
    type Grant = Lease;
    type Contender = ();

    fn contender(
        self: &Arc<Self>,
        _: &Self::Key,
        _: Instant,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(())
    }

    fn pauses(&self) -> Backoff {
        Backoff::new(FIRST_RETRY, self.config.settings.poll_interval)
    }

    /// An attempt on every master at once, with a fresh token: a give-back marks its
    /// token on the masters that did not hold it, and a later attempt must not be
    /// refused by that. It counts if a majority granted it within the validity budget
    /// (the lease minus the time the majority took, minus the drift margin): a majority
    /// reached after it is worth nothing.
    async fn attempt(self: &Arc<Self>, _: &mut (), keys: &Arc<RedisKeys>, round: Round) -> Attempt {
        let Round { sent_at, limit } = round;
        let token = match fresh_token() {
            Ok(token) => token,
            Err(error) => return Attempt::Failed(Box::new(error)),
        };
        let mut in_flight = InFlight::new(self.clone(), keys.clone(), token);
        in_flight.sent(sent_at);
        let (votes, failed) = self.ask(keys, in_flight.token(), limit).await;
        let timing = self.timing();
        if votes.won() && Instant::now() < timing.valid_until(sent_at, timing.first_ttl()) {
            let token = in_flight.granted();
            return Attempt::Granted(ttl::grant(self, keys.clone(), token, None, sent_at));
        }
        self.give_back_partial(keys, in_flight, &votes, limit).await;
        if votes.unreachable() {
            let error = Box::new(NoMajority {
                answered: self.masters.len() - votes.no_answer,
                masters: self.masters.len(),
                failed,
            });
            // Refused before the limit (masters down): definite. Silent until it: as
            // any attempt that went unanswered, a timeout if the wait cut it short.
            return match Instant::now() < limit {
                true => Attempt::Failed(error),
                false => Attempt::OutOfTime(Some(error)),
            };
        }
        // One ms past the shortest hold, a master is free again.
        let free_by = votes
            .shortest_hold_ms
            .map(|ms| Instant::now() + Duration::from_millis(ms + 1));
        if votes.held_back_by_restarts() {
            let wait = Duration::from_millis(votes.restart_wait_ms.unwrap_or_default());
            let refusal = restart_guard(self.config.settings.lease, wait);
            return Attempt::HeldBack {
                until: Instant::now() + wait,
                refusal: Box::new(refusal),
            };
        }
        match votes.granted {
            0 => Attempt::Held { free_by },
            _ => Attempt::Raced { free_by },
        }
    }

    fn named(&self, error: Box<dyn std::error::Error + Send + Sync>) -> LockError {
        LockError::Backend(error)
    }

    fn no_answer(&self) -> Box<dyn std::error::Error + Send + Sync> {
        let masters = self.masters.len();
        Box::new(NoMajority {
            answered: 0,
            masters,
            failed: Vec::new(),
        })
    }
}

impl Inner {
    /// Settles an attempt that won nothing: a split vote's partial grant is given back
    /// at once (by `until`), so that it holds no other contender off during the next
    /// pause; whatever may still be held under the token after that (a master that did
    /// not answer, the attempt or the give-back) is given back on every master by
    /// `in_flight`'s drop, in a task of its own, until every master answered.
    async fn give_back_partial(
        &self,
        keys: &Arc<RedisKeys>,
        mut in_flight: InFlight<Self>,
        votes: &Votes,
        until: Instant,
    ) {
        if votes.nothing_granted() {
            in_flight.answered();
        } else if votes.granted > 0 && !votes.unreachable() {
            let give_back = self.try_give_back(keys, in_flight.token());
            let given_back = tokio::time::timeout_at(until, give_back).await;
            if matches!(given_back, Ok(GiveBack::Cleared | GiveBack::NotOurs)) {
                in_flight.answered();
            }
        }
    }

    /// One attempt on every master at once, each answer due by `limit`; decided as
    /// soon as a majority granted, else when every master answered (or `limit`).
    async fn ask(
        self: &Arc<Self>,
        keys: &Arc<RedisKeys>,
        token: &str,
        limit: Instant,
    ) -> (Votes, Vec<(String, String)>) {
        let ttl_ms = millis(self.timing().first_ttl());
        let guard_ms = match self.config.restart_guard {
            true => millis(self.config.settings.lease),
            false => 0,
        };
        let mut votes = Votes::new(self.masters.len());
        // The masters that gave no vote, and why (for the error if no majority answers).
        let mut failed = Vec::new();
        let ask = |master: usize| {
            let (inner, keys, token) = (self.clone(), keys.clone(), token.to_owned());
            async move {
                let (vote, error) = inner.masters[master]
                    .acquire(
                        &keys,
                        &token,
                        ttl_ms,
                        guard_ms,
                        limit,
                        &inner.config.settings.instance_id,
                    )
                    .await;
                (master, vote, error)
            }
        };
        let mut answered = vec![false; self.masters.len()];
        let asked = ask_all(self.masters.len(), ask, |(master, vote, error)| {
            answered[master] = true;
            if let Some(error) = error {
                failed.push((self.masters[master].address.clone(), error.to_string()));
            }
            votes.count(vote)
        });
        // Each master's request ends at `limit`, in a task of its own that may run only
        // after the acquire loop cut this attempt there: what has not come in by then
        // counts as no answer here, so the attempt keeps its verdict and names them.
        if timeout_at(limit, asked).await.is_err() {
            for (master, _) in answered.iter().enumerate().filter(|(_, seen)| !**seen) {
                votes.count(Vote::NoAnswer);
                let address = self.masters[master].address.clone();
                failed.push((address, "no answer by the attempt's limit".to_owned()));
            }
        }
        (votes, failed)
    }
}

/// The restart guard of a majority refuses grants for `wait` more, longer than the
/// request may wait: a [`RetryLater`], so the client is told why and for how long.
fn restart_guard(lease: Duration, wait: Duration) -> RetryLater {
    let detail = format!(
        "restart guard: too many lock servers started less than a lease ({lease:?}) and \
         a second ago for a majority, and a lock they lost may still be held elsewhere; \
         grants resume in {wait:?}"
    );
    RetryLater::new(detail, wait)
}

impl TtlBackend for Inner {
    type Target = Arc<RedisKeys>;

    fn timing(&self) -> Timing {
        self.config.settings.timing()
    }

    /// Renewed only when a majority extended the key before `limit` (the end of the
    /// validity too): a renewal that reached fewer proves nothing, and the lease keeps
    /// its deadline. Definitely lost once more masters than a minority said "not ours".
    async fn renew(
        &self,
        keys: &Arc<RedisKeys>,
        token: &str,
        ttl: Duration,
        _sent: Instant,
        limit: Instant,
    ) -> Renewal {
        let mut replies = Replies::new(self.masters.len());
        let ttl_ms = millis(ttl);
        let masters = self.masters.clone();
        let ask = |master: usize| {
            let (masters, keys, token) = (masters.clone(), keys.clone(), token.to_owned());
            async move { masters[master].renew(&keys, &token, ttl_ms, limit).await }
        };
        ask_all(self.masters.len(), ask, |reply| {
            replies.count(reply);
            replies.ours_on_a_majority() || replies.lost_on_a_majority()
        })
        .await;
        if replies.ours_on_a_majority() && Instant::now() < limit {
            Renewal::Renewed
        } else if replies.lost_on_a_majority() {
            Renewal::NotOurs
        } else {
            Renewal::Unknown
        }
    }

    /// Compare-and-delete on every master; settled when every master answered or is
    /// down (refuses connections): retrying a dead master for the mark's life, once per
    /// release or failed attempt, would pile up tasks while nothing it held outlives
    /// its TTL.
    async fn try_give_back(&self, keys: &Arc<RedisKeys>, token: &str) -> GiveBack {
        let mut replies = Replies::new(self.masters.len());
        let mark_ms = millis(given_back_mark(&self.config));
        let masters = self.masters.clone();
        let ask = |master: usize| {
            let (masters, keys, token) = (masters.clone(), keys.clone(), token.to_owned());
            async move { masters[master].release(&keys, &token, mark_ms).await }
        };
        ask_all(self.masters.len(), ask, |reply: Reply| {
            replies.count(reply);
            false
        })
        .await;
        if replies.no_answer > 0 {
            GiveBack::NoAnswer
        } else if replies.ours > 0 {
            GiveBack::Cleared
        } else {
            GiveBack::NotOurs
        }
    }

    fn engine(&self) -> &'static str {
        "redlock"
    }

    fn schedule(&self) -> Option<&ttl::Schedule<Self>> {
        Some(&self.schedule)
    }

    /// Not the grant's expiry: a master runs an attempt when it gets it, which a frozen
    /// master can put off for longer than a lease. Until the give-back is answered
    /// everywhere, the attempt may still come; once it is, the mark refuses it.
    fn give_back_until(&self, sent_at: Instant) -> Instant {
        sent_at + given_back_mark(&self.config)
    }

    /// At once: a give-back that finds the key not ours marks the token, and the
    /// acquire script grants nothing to a marked token.
    fn settles_at(&self, sent_at: Instant, _answered_at: Instant) -> Instant {
        sent_at
    }
}

/// Whole milliseconds, at least 1 (Redis rejects a zero `PX`).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}
