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
/// Until `settled`, a write made with `token` may still land: the attempt of a dropped
/// acquisition can reach the engine after its give-back (another connection, served
/// first). A give-back that finds the record not ours before then looks again, so such
/// a late grant is cleared too, not left to expire.
pub(crate) async fn give_back<B: TtlBackend>(
    backend: &Arc<B>,
    target: B::Target,
    token: String,
    until: Instant,
    settled: Instant,
) {
    let done = move |outcome| is_settled(outcome, settled);
    if done(backend.try_give_back(&target, &token).await) {
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
            if done(backend.try_give_back(&target, &token).await) {
                return;
            }
        }
        tracing::debug!(
            engine = backend.engine(),
            "lock release failed; the record expires by its lease"
        );
    });
}

/// Whether a give-back that had `outcome` is over: no record of the token can be left
/// or still land after `settled`.
fn is_settled(outcome: GiveBack, settled: Instant) -> bool {
    match outcome {
        GiveBack::Cleared => true,
        GiveBack::NotOurs => Instant::now() >= settled,
        GiveBack::NoAnswer => false,
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
        if is_settled(outcome, self.backend.settles_at(sent_at)) {
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
            let settled = backend.settles_at(sent_at);
            runtime.spawn(async move { give_back(&backend, target, token, until, settled).await });
        }
    }
}
