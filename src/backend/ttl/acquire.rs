//! The acquire loop of the engines whose lock is one record, taken by a conditional
//! write and waited for by looking again (DynamoDB, Azure Blob): an attempt, and while
//! the key is held or the engine fails in passing, a pause and another attempt, until
//! the wait ends. The engine brings the attempt ([`Contend::attempt`]); the loop owns
//! the timing every such engine must get the same way:
//!
//! - the first attempt gets a whole command timeout, so a zero wait still tries once;
//!   later ones end with the wait, so no acquisition outlives its wait by more than one
//!   command timeout;
//! - only the wait bounds the waiting (DESIGN rule 11): an attempt that failed in
//!   passing (no answer, throttled, a broken connection) is tried again after a pause,
//!   within the wait;
//! - a wait that ends while the engine's last word was a failure ends with that
//!   failure (503), not with a timeout (409, 429): an unreachable engine is not a busy
//!   key.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, timeout_at, Instant};

use super::{deadline_after, Backoff, TtlBackend};
use crate::backend::Lease;
use crate::LockError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one attempt found.
pub(crate) enum Attempt {
    /// Granted: the lease, its in-flight guard disarmed.
    Granted(Lease),
    /// Held by another; the next attempt waits no longer than `free_by` if it is set
    /// (when the holder, as seen, may be taken over).
    Held { free_by: Option<Instant> },
    /// Failed in passing: tried again within the wait; the acquisition ends with it if
    /// the wait ends first.
    Retry(BoxError),
    /// Failed for good: the acquisition ends with it.
    Failed(BoxError),
    /// Its calls reached `limit` unanswered: as if the loop had cut it there.
    OutOfTime,
}

/// An engine's side of the acquire loop; its [`timing`](TtlBackend::timing)'s command
/// timeout is the longest one attempt may take.
pub(crate) trait Contend: TtlBackend {
    /// What one acquisition contends for (an item's key, a blob).
    type Key: Send + Sync;

    /// The pauses between attempts: jittered, from short to the poll interval.
    fn pauses(&self) -> Backoff;

    /// One attempt on `key`, whose calls end by `limit` (the loop cuts it there too).
    /// The attempt keeps its own in-flight guard, so that a grant whose answer never
    /// came (an error, `limit`, this future dropped) is given back.
    fn attempt(
        self: &Arc<Self>,
        key: &Self::Key,
        limit: Instant,
    ) -> impl Future<Output = Attempt> + Send;

    /// An engine failure as the caller sees it: the engine and where it is, then why.
    fn named(&self, error: BoxError) -> LockError;

    /// An attempt's own error for a command timeout.
    fn no_answer(&self) -> BoxError;
}

/// Acquires `key` on `backend`, attempting until granted or the wait ends.
pub(crate) async fn acquire<B: Contend>(
    backend: &Arc<B>,
    key: &B::Key,
    wait: Duration,
) -> Result<Lease, LockError> {
    let deadline = deadline_after(wait);
    let command_timeout = backend.timing().command_timeout;
    let mut backoff = backend.pauses();
    // The last attempt's failure, if no attempt was answered since.
    let mut failing: Option<BoxError> = None;
    let out_of_time = |failing: Option<BoxError>| match failing {
        Some(error) => backend.named(error),
        None => LockError::Timeout,
    };
    let mut first = true;
    loop {
        let sent_at = Instant::now();
        let limit = match first {
            true => sent_at + command_timeout,
            false => (sent_at + command_timeout).min(deadline),
        };
        let mut free_by = None;
        let attempt = timeout_at(limit, backend.attempt(key, limit)).await;
        match attempt.unwrap_or(Attempt::OutOfTime) {
            Attempt::Granted(lease) => return Ok(lease.with_contention(!first)),
            Attempt::Held { free_by: by } => {
                failing = None;
                free_by = by;
            }
            Attempt::Retry(error) => {
                tracing::debug!(%error, "lock attempt failed; tried again within the wait");
                failing = Some(error);
            }
            Attempt::Failed(error) => return Err(backend.named(error)),
            Attempt::OutOfTime if limit == deadline => return Err(out_of_time(failing)),
            // No answer within a whole command timeout: tried again within the wait,
            // as a broken connection is.
            Attempt::OutOfTime => failing = Some(backend.no_answer()),
        }
        first = false;
        let now = Instant::now();
        if now >= deadline {
            return Err(out_of_time(failing));
        }
        let mut pause = backoff.pause().min(deadline - now);
        if let Some(by) = free_by.filter(|by| now < *by) {
            pause = pause.min(by - now);
        }
        sleep(pause).await;
        if Instant::now() >= deadline {
            return Err(out_of_time(failing));
        }
    }
}
