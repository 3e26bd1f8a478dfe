//! A held lock: the task that checks its connection every liveness interval, and the
//! unlock on release.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::session::Session;
use super::Inner;
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, ReleaseLease};

const UNLOCK_SQL: &str = "SELECT pg_advisory_unlock($1)";

impl Inner {
    /// Hands the locked session to a task that watches it until the lease is released.
    pub(super) fn hold(self: Arc<Self>, session: Session, id: i64, token: Option<u64>) -> Lease {
        let (lost, signal) = LeaseSignal::new();
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(self.watch(session, id, lost, stopped));
        Lease::new(token, signal, PgRelease { stop, task })
    }

    /// Checks the held connection every liveness interval until the lease is released
    /// (or dropped), then unlocks. If the runtime drops this task instead, `session`'s
    /// drop closes the connection, which frees the lock.
    async fn watch(
        self: Arc<Self>,
        session: Session,
        id: i64,
        lost: LeaseLostSender,
        mut stop: oneshot::Receiver<()>,
    ) {
        let interval = self.liveness_interval;
        let mut ticks = tokio::time::interval_at(Instant::now() + interval, interval);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            // `stop` fires on release, and on its sender's drop.
            if let Either::Left(_) = race(&mut stop, ticks.tick()).await {
                break;
            }
            let alive = !session.is_closed()
                && match race(&mut stop, self.round_trip(session.simple_query("SELECT 1"))).await {
                    Either::Left(_) => break,
                    Either::Right(ping) => ping.is_ok(),
                };
            if !alive {
                // The session ended (so PostgreSQL freed the lock) or went silent: another
                // instance may hold the key now, or soon. Close our end too.
                if lost.lose() {
                    tracing::warn!(lock_id = id, "PostgreSQL lock lost: its connection died");
                }
                return;
            }
        }
        let unlocked = self
            .round_trip(async {
                let statement = session.prepare_cached(UNLOCK_SQL).await?;
                session.query_one(&statement, &[&id]).await
            })
            .await;
        // Only a connection known to hold nothing goes back; otherwise `session` is
        // dropped here: closed, so PostgreSQL ends the session and frees its locks.
        match unlocked {
            Ok(row) if row.get::<_, bool>(0) => session.give_back(),
            Ok(_) => tracing::warn!(lock_id = id, "PostgreSQL lock was not held at release"),
            Err(error) => {
                tracing::debug!(lock_id = id, %error, "unlock failed; closing the connection")
            }
        }
    }
}

/// Ends a lease: stops its watch task, which then unlocks.
struct PgRelease {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl ReleaseLease for PgRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        let PgRelease { stop, task } = *self;
        let _ = stop.send(());
        Box::pin(async move {
            let _ = task.await;
        })
    }
}

enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Polls both futures; the first ready wins (`left` first). The other is dropped.
async fn race<A: Future + Unpin, B: Future>(mut left: A, right: B) -> Either<A::Output, B::Output> {
    let mut right = pin!(right);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(value) = std::pin::Pin::new(&mut left).poll(cx) {
            return Poll::Ready(Either::Left(value));
        }
        right.as_mut().poll(cx).map(Either::Right)
    })
    .await
}
