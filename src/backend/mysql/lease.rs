//! A held lock: the task that checks its session (alive? still the same session? still
//! holding the lock?) until release, and the checked `RELEASE_LOCK` on release.

use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::acquire::Granted;
use super::error::SHARED_SESSION;
use super::lock_name::hex_literal;
use super::session::{number, Session};
use super::Inner;
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LostReason, ReleaseLease};

impl Inner {
    /// Hands the locked session (`CONNECTION_ID()` `id`) to a task that checks it until
    /// the lease is released. The checks count from `granted.since`, the sending of the
    /// last round trip known to have reset the server's idle limit, so the holder is
    /// told a network timeout before that limit can end the session.
    pub(super) fn hold(
        self: Arc<Self>,
        session: Session,
        name: String,
        id: u64,
        granted: Granted,
    ) -> Lease {
        let since = granted.since;
        // Lost at the next check's timeout unless it answers in time: an instant on the
        // clock, so a holder whose runtime stalls knows it too.
        let (lost, signal) = LeaseSignal::with_deadline(self.valid_until(since));
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(self.watch(session, name, id, since, lost, stopped));
        Lease::new(granted.token, signal, MyRelease { stop, task })
    }

    /// Checks the held session until the lease is released (or dropped), then releases
    /// the lock. If the runtime drops this task instead, `session`'s drop closes the
    /// connection, which frees the lock.
    async fn watch(
        self: Arc<Self>,
        mut session: Session,
        name: String,
        id: u64,
        since: Instant,
        lost: LeaseLostSender,
        mut stop: oneshot::Receiver<()>,
    ) {
        let literal = hex_literal(&name);
        let check = format!("SELECT CONNECTION_ID(), IS_USED_LOCK({literal}) <=> CONNECTION_ID()");
        let interval = self.liveness_interval;
        let mut checks = tokio::time::interval_at(since + interval, interval);
        checks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            // `stop` fires on release, and on its sender's drop.
            tokio::select! {
                biased;
                _ = &mut stop => break,
                _ = checks.tick() => {
                    let sent = Instant::now();
                    let (answer, released) = {
                        let check = session.rows(&check, self.network_timeout);
                        tokio::pin!(check);
                        tokio::select! {
                            biased;
                            answer = &mut check => (answer, false),
                            // Released mid-check: the check's answer is on its way, and
                            // a statement cut short would leave the connection unusable
                            // (closed, the lock freed only once the server notices), so
                            // the check runs to its end (within the network timeout)
                            // and RELEASE_LOCK follows.
                            _ = &mut stop => (check.await, true),
                        }
                    };
                    if released {
                        if answer.is_err() {
                            // `session` is dropped: closed, which frees the lock.
                            return;
                        }
                        break;
                    }
                    let row = match answer {
                        Ok(rows) => rows.into_iter().last(),
                        Err(error) => {
                            tracing::warn!(lock = %name, %error, "MySQL lock lost: its connection failed");
                            lost.lose(LostReason::Unreachable);
                            return;
                        }
                    };
                    let answered_by = row.as_ref().and_then(|row| number(row, 0));
                    let held = row.as_ref().and_then(|row| number(row, 1)) == Some(1);
                    if answered_by != Some(id as i64) || !held {
                        tracing::error!(lock = %name, "MySQL lock lost: {SHARED_SESSION}");
                        lost.lose(LostReason::NotOwner);
                        return;
                    }
                    if !lost.extend(self.valid_until(sent)) {
                        tracing::warn!(lock = %name, "MySQL lock lost: its holder stalled past its deadline");
                        return;
                    }
                }
            }
        }
        // Released: only a session known to hold nothing goes back to the pool;
        // otherwise `session` is dropped here: closed, so the server frees its locks.
        let release = format!("SELECT CONNECTION_ID(), RELEASE_LOCK({literal})");
        match session.rows(&release, self.network_timeout).await {
            Ok(rows) => {
                let row = rows.last();
                let answered_by = row.and_then(|row| number(row, 0));
                match row.and_then(|row| number(row, 1)) {
                    Some(1) if answered_by == Some(id as i64) => session.give_back(),
                    Some(1) => tracing::error!(lock = %name, "MySQL release: {SHARED_SESSION}"),
                    // 0: another session holds it; NULL: nobody does. Either way this
                    // session had lost it: closed, not pooled.
                    _ => tracing::warn!(lock = %name, "MySQL lock was not held at release"),
                }
            }
            Err(error) => {
                tracing::debug!(lock = %name, %error, "RELEASE_LOCK failed; closing the connection")
            }
        }
    }

    /// Until when a session whose idle limit was reset by a round trip sent at `sent`
    /// counts as held: the next liveness check's timeout, at least one network timeout
    /// before the server's idle limit can end the session.
    fn valid_until(&self, sent: Instant) -> Instant {
        sent + self.liveness_interval + self.network_timeout
    }
}

/// Ends a lease: stops its watch task, which then releases the lock.
struct MyRelease {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl ReleaseLease for MyRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        let MyRelease { stop, task } = *self;
        let _ = stop.send(());
        Box::pin(async move {
            let _ = task.await;
        })
    }
}
