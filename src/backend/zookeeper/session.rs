//! The ZooKeeper session every lock of a backend shares: connected on first use, kept
//! heard by a heartbeat, declared lost at its local deadline or when ZooKeeper says it
//! expired, and then replaced by a new one for later acquisitions.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::{sleep_until, timeout_at, Instant};
use zookeeper_client as zk;

use super::config::Config;

/// What the locks of a session know of it: lost, or ours until a deadline.
#[derive(Debug, Clone, Copy)]
pub(super) struct Health {
    /// The session counts as alive at ZooKeeper until then, modulo drift (see
    /// [`Session::heard`]).
    pub(super) valid_until: Instant,
    /// Expired, closed, or its local deadline passed: its nodes are gone or going, and
    /// the backend will not use it again.
    pub(super) lost: bool,
    /// A heartbeat went unanswered since the last one answered: should the deadline
    /// pass now, ZooKeeper was out of reach.
    pub(super) unanswered: bool,
    /// ZooKeeper said the session expired: it could be reached, and the session's nodes
    /// are gone.
    pub(super) expired: bool,
    /// When the session was declared lost, its client was connected: ZooKeeper could
    /// be reached again (the path healed just too late).
    pub(super) connected_when_lost: bool,
}

/// One ZooKeeper session and its heartbeat.
pub(super) struct Session {
    /// Taken (and dropped, which closes the session) once the session is lost, so
    /// that a session this process gave up on frees its nodes at once instead of
    /// living on with them; `None` from then on.
    client: Mutex<Option<zk::Client>>,
    /// The negotiated session timeout.
    timeout: Duration,
    health: watch::Sender<Health>,
    heartbeat: AbortHandle,
}

impl Session {
    /// Opens a session, bounded by the connect timeout; its heartbeat starts at once.
    pub(super) async fn open(config: &Config) -> Result<Arc<Self>, zk::Error> {
        let started = Instant::now();
        let connect = zk::Client::connector()
            .with_session_timeout(config.settings.lease)
            .with_connection_timeout(config.settings.command_timeout)
            .connect(&config.servers);
        let client = match timeout_at(started + config.connect_timeout(), connect).await {
            Ok(client) => client?,
            Err(_) => return Err(zk::Error::Timeout),
        };
        // The server negotiates the timeout (between 2 and 20 ticks): count with its
        // figure, never ours.
        let timeout = client.session_timeout();
        let (health, _) = watch::channel(Health {
            valid_until: valid_until(started, timeout, config.settings.drift()),
            lost: false,
            unanswered: false,
            expired: false,
            connected_when_lost: false,
        });
        let session = Arc::new_cyclic(|weak: &Weak<Session>| {
            let task = tokio::spawn(keep_heard(
                weak.clone(),
                client.state_watcher(),
                started,
                timeout,
                config.settings.drift(),
                config.settings.command_timeout,
            ));
            Session {
                client: Mutex::new(Some(client)),
                timeout,
                health,
                heartbeat: task.abort_handle(),
            }
        });
        Ok(session)
    }

    /// What is known of the session now; a session whose deadline passed is lost,
    /// whether or not its heartbeat task has run since.
    pub(super) fn health(&self) -> Health {
        let health = *self.health.borrow();
        Health {
            lost: health.lost || Instant::now() >= health.valid_until,
            ..health
        }
    }

    /// Whether the session is lost (see [`Health::lost`]).
    pub(super) fn is_lost(&self) -> bool {
        self.health().lost
    }

    /// Follows the session's health: a new value on every heartbeat answered, and when
    /// it is lost.
    pub(super) fn subscribe(&self) -> watch::Receiver<Health> {
        self.health.subscribe()
    }

    /// Resolves when the session is lost.
    pub(super) async fn lost(&self) {
        let mut health = self.subscribe();
        loop {
            let now = *health.borrow_and_update();
            if now.lost {
                return;
            }
            tokio::select! {
                changed = health.changed() => if changed.is_err() { return },
                () = sleep_until(now.valid_until) => return,
            }
        }
    }

    /// The session's client (a cheap clone), unless the session is lost.
    pub(super) fn client(&self) -> Option<zk::Client> {
        if self.is_lost() {
            self.lose();
            return None;
        }
        self.client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The negotiated session timeout.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Records that ZooKeeper said the session expired (see [`Health::expired`]).
    pub(super) fn expired(&self) {
        self.health
            .send_if_modified(|health| !std::mem::replace(&mut health.expired, true));
    }

    /// Marks the session lost and closes it (once the requests in flight end).
    pub(super) fn lose(&self) {
        let client = self
            .client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let connected = client
            .as_ref()
            .is_some_and(|client| client.state() == zk::SessionState::SyncConnected);
        self.health.send_if_modified(|health| {
            if health.lost {
                return false;
            }
            health.lost = true;
            health.connected_when_lost = connected;
            true
        });
        drop(client);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Dropping the client closes the session: its nodes go with it.
        self.heartbeat.abort();
    }
}

/// Records that ZooKeeper said `session` expired, if it is still there.
fn expired(session: &Weak<Session>) {
    if let Some(live) = session.upgrade() {
        live.expired();
    }
}

/// Until when a session heard by a request sent at `sent` is alive at ZooKeeper,
/// modulo drift.
fn valid_until(sent: Instant, timeout: Duration, drift: Duration) -> Instant {
    sent + timeout.saturating_sub(drift)
}

/// The session's deadline, moved by the heartbeats answered: counted from the send
/// time of the heartbeat *before* the last one answered (see [`keep_heard`]).
#[derive(Debug)]
struct Deadline {
    timeout: Duration,
    drift: Duration,
    /// The send time of the newest heartbeat answered (or of the connect), which the
    /// deadline does not count from yet.
    latest: Instant,
    valid_until: Instant,
}

impl Deadline {
    /// A session whose connect was sent at `connected_at`.
    fn new(connected_at: Instant, timeout: Duration, drift: Duration) -> Self {
        Deadline {
            timeout,
            drift,
            latest: connected_at,
            valid_until: valid_until(connected_at, timeout, drift),
        }
    }

    /// A heartbeat sent at `sent` was answered: the deadline moves to count from the
    /// one answered before it (never backwards). Returns the new deadline.
    fn answered(&mut self, sent: Instant) -> Instant {
        let earlier = sent.min(self.latest);
        self.latest = sent.max(self.latest);
        self.valid_until = valid_until(earlier, self.timeout, self.drift).max(self.valid_until);
        self.valid_until
    }
}

/// The heartbeat: a `sync` (answered only through the leader, so a server cut off from
/// the quorum cannot answer it) every third of the session timeout. The deadline is
/// counted from the send time of the heartbeat *before* the last one answered: a
/// follower passes the touch of a request to the leader on its next ping, so the last
/// one may not have reached the leader yet, while the one before it has (the leader
/// answered a later request on the same link). Ends when the session is lost.
async fn keep_heard(
    session: Weak<Session>,
    mut state: zk::StateWatcher,
    connected_at: Instant,
    timeout: Duration,
    drift: Duration,
    command_timeout: Duration,
) {
    // `session` cannot be upgraded yet: this task starts while it is being made.
    let period = timeout / 3;
    // Invariant: `deadline.valid_until` is what the health says.
    let mut deadline = Deadline::new(connected_at, timeout, drift);
    let mut next = connected_at + period;
    loop {
        tokio::select! {
            biased;
            () = sleep_until(deadline.valid_until) => break,
            changed = state.changed() => {
                if changed.is_terminated() {
                    if changed == zk::SessionState::Expired {
                        expired(&session);
                    }
                    break;
                }
                continue;
            }
            () = sleep_until(next) => {}
        }
        let Some(live) = session.upgrade() else {
            return;
        };
        let Some(client) = live.client() else {
            break;
        };
        let sent = Instant::now();
        let limit = (sent + command_timeout).min(deadline.valid_until);
        match timeout_at(limit, client.sync("/")).await {
            Ok(Ok(())) => {
                let valid_until = deadline.answered(sent);
                live.health.send_modify(|health| {
                    health.valid_until = valid_until;
                    health.unanswered = false;
                });
                next = sent + period;
            }
            Ok(Err(error))
                if error == zk::Error::SessionExpired || error == zk::Error::ClientClosed =>
            {
                if error == zk::Error::SessionExpired {
                    live.expired();
                }
                break;
            }
            _ => {
                live.health
                    .send_if_modified(|health| !std::mem::replace(&mut health.unanswered, true));
                next = Instant::now() + period / 4;
            }
        }
    }
    if let Some(live) = session.upgrade() {
        live.lose();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_counts_from_the_heartbeat_before_the_last_answered() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut deadline = Deadline::new(t0, ms(3000), ms(30));
        assert_eq!(deadline.valid_until, t0 + ms(2970));
        // The first heartbeat answered: the deadline still counts from the connect.
        assert_eq!(deadline.answered(t0 + ms(1000)), t0 + ms(2970));
        // The second: it counts from the first.
        assert_eq!(deadline.answered(t0 + ms(2000)), t0 + ms(3970));
        assert_eq!(deadline.answered(t0 + ms(3000)), t0 + ms(4970));
        // An answer to an older send never moves it back.
        assert_eq!(deadline.answered(t0 + ms(1500)), t0 + ms(4970));
    }
}
