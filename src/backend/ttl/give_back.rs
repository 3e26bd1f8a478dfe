//! Giving a token's hold back: once, then in the background until the record would
//! expire anyway; and the guard that gives back what an unanswered attempt may hold.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::{Backoff, GiveBack, TtlBackend};

/// Backoff of a give-back retried in the background: from this, doubling up to a
/// quarter lease (at most `RETRY_MAX`), so a record granted to a token nobody holds is
/// freed soon after the engine answers again, not a lease later.
const RETRY_MIN: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Clears `target` if `token` still holds it. Returns after one try; if that settles
/// nothing, tries again in the background with backoff until `until` (when the record
/// expires, or a waiter takes it over, by itself).
///
/// `in_flight_since`: when the token's attempt whose answer never came was sent (`None`
/// when every write of the token was answered). Such a write may still land (the
/// attempt of a dropped acquisition can reach the engine after its give-back: another
/// connection, served first; a paused server runs it once resumed), so a give-back that
/// finds the record not ours looks again until the engine's
/// [`settles_at`](TtlBackend::settles_at), and a late grant is cleared too, not left to
/// expire.
pub(crate) async fn give_back<B: TtlBackend>(
    backend: &Arc<B>,
    target: B::Target,
    token: String,
    until: Instant,
    in_flight_since: Option<Instant>,
) {
    let mut settling = Settling::new(in_flight_since);
    if settling.is_over(&**backend, backend.try_give_back(&target, &token).await) {
        return;
    }
    let backend = backend.clone();
    tokio::spawn(async move {
        let longest = (backend.timing().lease / 4).clamp(RETRY_MIN, RETRY_MAX);
        let mut backoff = Backoff::new(RETRY_MIN, longest);
        loop {
            let pause = backoff.pause();
            if Instant::now() + pause >= until {
                break;
            }
            sleep(pause).await;
            if settling.is_over(&*backend, backend.try_give_back(&target, &token).await) {
                return;
            }
        }
        tracing::debug!(
            engine = backend.engine(),
            "lock release failed; the record expires by its lease"
        );
    });
}

/// One give-back try by one `call`, answered within `limit`: cleared if it succeeded,
/// not ours if its refusal says so (`not_ours`), no answer otherwise (logged as `what`
/// failed or timed out).
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "etcd"))]
pub(crate) async fn give_back_call<T, E: std::fmt::Display>(
    what: &str,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, E>>,
    not_ours: impl Fn(&E) -> bool,
) -> GiveBack {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(_)) => GiveBack::Cleared,
        Ok(Err(error)) if not_ours(&error) => GiveBack::NotOurs,
        Ok(Err(error)) => {
            tracing::debug!(%error, "{what} failed");
            GiveBack::NoAnswer
        }
        Err(_) => {
            tracing::debug!("{what} timed out");
            GiveBack::NoAnswer
        }
    }
}

/// Whether a give-back is over: no record of the token can be left, or still land.
struct Settling {
    /// When the attempt in flight was sent, if one is.
    in_flight_since: Option<Instant>,
    /// When the engine first answered a try of this give-back.
    answered_at: Option<Instant>,
}

impl Settling {
    fn new(in_flight_since: Option<Instant>) -> Self {
        Settling {
            in_flight_since,
            answered_at: None,
        }
    }

    /// Whether a try that had `outcome`, just now, ends the give-back.
    fn is_over<B: TtlBackend>(&mut self, backend: &B, outcome: GiveBack) -> bool {
        let now = Instant::now();
        match outcome {
            GiveBack::Cleared => true,
            GiveBack::NoAnswer => false,
            GiveBack::NotOurs => {
                let answered_at = *self.answered_at.get_or_insert(now);
                self.in_flight_since
                    .is_none_or(|sent_at| now >= backend.settles_at(sent_at, answered_at))
            }
        }
    }
}

/// An acquisition's token, armed while an attempt may have been granted without us
/// knowing: an error, a timeout, or the acquire future dropped mid-attempt. The write
/// may then have happened (or may still happen: a silent engine can wake up), so
/// dropping it gives back what the token may hold rather than leave the key blocked
/// for a lease.
pub(crate) struct InFlight<B: TtlBackend> {
    backend: Arc<B>,
    target: B::Target,
    token: String,
    /// When the attempt in flight was sent; `None` when none is.
    sent_at: Option<Instant>,
}

impl<B: TtlBackend> InFlight<B> {
    /// A token for attempts on `target`, disarmed.
    pub(crate) fn new(backend: Arc<B>, target: B::Target, token: String) -> Self {
        Self {
            backend,
            target,
            token,
            sent_at: None,
        }
    }

    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    /// Arms the guard: an attempt was sent at `sent_at`.
    pub(crate) fn sent(&mut self, sent_at: Instant) {
        self.sent_at = Some(sent_at);
    }

    /// Disarms the guard: the attempt's answer is known, and granted nothing.
    pub(crate) fn answered(&mut self) {
        self.sent_at = None;
    }

    /// Gives back now what the token may hold, one try awaited, before the caller hears
    /// that its wait is over: a waiter still queued at the engine would be granted the
    /// next release, and the key would stay blocked (for this instance's next
    /// `try_lock` too) until a background give-back ran. Disarmed once settled; if not
    /// (no answer, or dropped mid-try), the drop retries in the background as before.
    // Only engines that queue waiters at the server (Redis) need it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) async fn give_back(&mut self) {
        let Some(sent_at) = self.sent_at else {
            return;
        };
        let outcome = self.backend.try_give_back(&self.target, &self.token).await;
        if Settling::new(Some(sent_at)).is_over(&*self.backend, outcome) {
            self.sent_at = None;
        }
    }

    /// Disarms the guard and hands over the token: the attempt was granted.
    pub(crate) fn granted(&mut self) -> String {
        self.sent_at = None;
        std::mem::take(&mut self.token)
    }
}

impl<B: TtlBackend> Drop for InFlight<B> {
    fn drop(&mut self) {
        let Some(sent_at) = self.sent_at else {
            return;
        };
        // Without a runtime (it is shutting down) the record expires by its lease.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (backend, target) = (self.backend.clone(), self.target.clone());
            let token = std::mem::take(&mut self.token);
            let until = backend.give_back_until(sent_at);
            runtime.spawn(
                async move { give_back(&backend, target, token, until, Some(sent_at)).await },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::backend::ttl::{Renewal, Timing};

    const COMMAND_TIMEOUT: Duration = Duration::from_millis(100);

    /// One record on an engine paused until `resumes_at`: tries before then go
    /// unanswered. Whoever holds the record is its token. A `queued` write runs right
    /// after the first try the resumed engine answers.
    struct Paused {
        resumes_at: Instant,
        record: Mutex<Option<String>>,
        queued: Mutex<Option<String>>,
    }

    impl TtlBackend for Paused {
        type Target = ();

        fn timing(&self) -> Timing {
            Timing::new(Duration::from_secs(10), Duration::ZERO, COMMAND_TIMEOUT)
        }

        async fn renew(&self, _: &(), _: &str, _: Duration, _: Instant, _: Instant) -> Renewal {
            Renewal::Unknown
        }

        async fn try_give_back(&self, _: &(), token: &str) -> GiveBack {
            if Instant::now() < self.resumes_at {
                sleep(COMMAND_TIMEOUT).await;
                return GiveBack::NoAnswer;
            }
            let mut record = self.record.lock().unwrap();
            let outcome = if record.as_deref() == Some(token) {
                *record = None;
                GiveBack::Cleared
            } else {
                GiveBack::NotOurs
            };
            if let Some(late) = self.queued.lock().unwrap().take() {
                *record = Some(late);
            }
            outcome
        }

        fn engine(&self) -> &'static str {
            "paused"
        }
    }

    /// An attempt sent to a paused engine lands after it resumes, just after the
    /// give-back's first answered try found the record free: the give-back keeps
    /// looking a command timeout past that answer and clears the late grant.
    #[tokio::test(start_paused = true)]
    async fn a_grant_landing_after_a_paused_engine_resumes_is_cleared() {
        let sent_at = Instant::now();
        let engine = Arc::new(Paused {
            resumes_at: sent_at + 10 * COMMAND_TIMEOUT,
            record: Mutex::default(),
            queued: Mutex::new(Some("ours".to_owned())),
        });
        let until = sent_at + engine.timing().lease;
        give_back(&engine, (), "ours".to_owned(), until, Some(sent_at)).await;
        tokio::time::sleep_until(until).await;
        assert_eq!(engine.queued.lock().unwrap().as_deref(), None, "it landed");
        assert_eq!(engine.record.lock().unwrap().as_deref(), None);
    }

    /// Without an attempt in flight, a record found not ours ends the give-back.
    #[tokio::test(start_paused = true)]
    async fn a_record_not_ours_ends_a_give_back_of_answered_writes() {
        let engine = Arc::new(Paused {
            resumes_at: Instant::now(),
            record: Mutex::new(Some("theirs".to_owned())),
            queued: Mutex::new(Some("ours".to_owned())),
        });
        let until = Instant::now() + engine.timing().lease;
        give_back(&engine, (), "ours".to_owned(), until, None).await;
        tokio::time::sleep_until(until).await;
        assert_eq!(engine.record.lock().unwrap().as_deref(), Some("ours"));
    }
}
