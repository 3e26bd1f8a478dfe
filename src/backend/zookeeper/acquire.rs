//! Joining a lock's queue and waiting for the turn: the contender's node (ephemeral,
//! sequential, named with the acquisition's token), a watch on its predecessor only,
//! and the give-back of a node nobody will hold (ZooKeeper's steps of the
//! `backend::ttl` engine's in-flight guard and background give-back).

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::{sleep, sleep_until, timeout_at, Instant};
use zookeeper_client as zk;

use super::keys::{parse_contender, LockPath};
use super::lease;
use super::session::Session;
use super::Inner;
use crate::backend::ttl::{
    self, fresh_token, jitter, GiveBack, InFlight, Renewal, Timing, TtlBackend,
};
use crate::backend::Lease;
use crate::LockError;

/// How many times a create that found no queue node makes it and tries again: the
/// server deletes an empty queue (a container node) by itself, possibly in between.
const CREATE_ATTEMPTS: usize = 3;

/// One acquisition at ZooKeeper: its session, its queue, its token, and its node once
/// the create was answered.
pub(super) struct Contender {
    pub(super) session: Arc<Session>,
    path: LockPath,
    pub(super) token: String,
    node: OnceLock<String>,
}

impl Contender {
    /// The path of the contender's node, if its create was answered.
    pub(super) fn node(&self) -> Option<&str> {
        self.node.get().map(String::as_str)
    }
}

impl fmt::Debug for Contender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Contender")
            .field("queue", &self.path.queue)
            .field("node", &self.node.get())
            .finish_non_exhaustive()
    }
}

/// Why an acquisition failed at ZooKeeper (inside [`LockError::Backend`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum ZooKeeperLockError {
    /// ZooKeeper did not answer a step within the command timeout.
    TimedOut(&'static str),
    /// The session expired, was closed, or went unheard past its local deadline: its
    /// nodes are gone or going. The next acquisition opens a new session.
    SessionLost,
    /// The waiter's node disappeared while it queued (deleted by hand, or its
    /// session ended).
    NodeGone,
    /// ZooKeeper refused a step.
    ZooKeeper(zk::Error),
}

impl fmt::Display for ZooKeeperLockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZooKeeperLockError::TimedOut(step) => {
                write!(
                    f,
                    "ZooKeeper did not answer within the command timeout ({step})"
                )
            }
            ZooKeeperLockError::SessionLost => f.write_str("the ZooKeeper session was lost"),
            ZooKeeperLockError::NodeGone => {
                f.write_str("the waiter's ZooKeeper node disappeared while it queued")
            }
            ZooKeeperLockError::ZooKeeper(error) => write!(f, "ZooKeeper: {error}"),
        }
    }
}

impl std::error::Error for ZooKeeperLockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ZooKeeperLockError::ZooKeeper(error) => Some(error),
            _ => None,
        }
    }
}

pub(super) fn backend(error: ZooKeeperLockError) -> LockError {
    LockError::Backend(Box::new(error))
}

/// What one look at the queue found.
enum Turn {
    /// No older contender: the lock is ours.
    Ours,
    /// The newest older contender's node.
    Behind(String),
}

impl Inner {
    pub(super) async fn acquire(
        self: Arc<Self>,
        path: LockPath,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let deadline = ttl::deadline_after(wait);
        let session = self.session().await?;
        let token = fresh_token()?;
        let contender = Arc::new(Contender {
            session: session.clone(),
            path,
            token: token.clone(),
            node: OnceLock::new(),
        });
        // Armed from the create on: dropping it (an error, the wait over, the future
        // dropped at any await) deletes the contender's node, found by its token if the
        // create's answer never came.
        let mut in_flight = InFlight::new(self.clone(), contender.clone(), token);
        let fence = self.join(&contender, &mut in_flight).await?;

        let command_timeout = self.config.command_timeout;
        let mut first = true;
        loop {
            if session.is_lost() {
                return Err(backend(ZooKeeperLockError::SessionLost));
            }
            // The first look gets a whole command timeout, so that a wait of zero
            // still tries once; later ones end with the wait.
            let limit = if first {
                Instant::now() + command_timeout
            } else {
                (Instant::now() + command_timeout).min(deadline)
            };
            first = false;
            let predecessor = match self.look(&contender, limit, deadline).await? {
                Turn::Ours => {
                    let Some(lease) = lease::grant(&self, contender, fence) else {
                        return Err(backend(ZooKeeperLockError::SessionLost));
                    };
                    in_flight.granted();
                    return Ok(lease);
                }
                Turn::Behind(predecessor) => predecessor,
            };
            if Instant::now() >= deadline {
                return Err(LockError::Timeout);
            }
            let limit = (Instant::now() + command_timeout).min(deadline);
            let Some(client) = session.client() else {
                return Err(backend(ZooKeeperLockError::SessionLost));
            };
            let watched = timeout_at(limit, client.check_and_watch_stat(&predecessor));
            let watcher = match watched.await {
                Ok(Ok((Some(_), watcher))) => watcher,
                // Gone already: look again.
                Ok(Ok((None, _))) => continue,
                Ok(Err(error)) => return Err(backend(ZooKeeperLockError::ZooKeeper(error))),
                Err(_) if limit == deadline => return Err(LockError::Timeout),
                Err(_) => {
                    return Err(backend(ZooKeeperLockError::TimedOut(
                        "watching the predecessor",
                    )))
                }
            };
            drop(client);
            tokio::select! {
                biased;
                () = sleep_until(deadline) => return Err(LockError::Timeout),
                () = session.lost() => return Err(backend(ZooKeeperLockError::SessionLost)),
                // Deleted (released, its session ended), or any other event: look again.
                _ = watcher.changed() => {}
                // The backstop for a watch that never fires.
                () = sleep(jitter(self.config.poll_interval)) => {}
            }
        }
    }

    /// Creates the contender's node (and the queue's nodes if missing); returns its
    /// fencing token, the node's creation zxid.
    async fn join(
        &self,
        contender: &Contender,
        in_flight: &mut InFlight<Inner>,
    ) -> Result<u64, LockError> {
        let lost = || backend(ZooKeeperLockError::SessionLost);
        let client = contender.session.client().ok_or_else(lost)?;
        let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        let prefix = contender.path.contender_prefix(&contender.token);
        let limit = |sent: Instant| sent + self.config.command_timeout;
        for _ in 0..CREATE_ATTEMPTS {
            let sent = Instant::now();
            in_flight.sent(sent);
            match timeout_at(
                limit(sent),
                client.create(&prefix, self.config.instance_id.as_bytes(), &ephemeral),
            )
            .await
            {
                Ok(Ok((stat, sequence))) => {
                    let _ = contender.node.set(format!("{prefix}{sequence}"));
                    return u64::try_from(stat.czxid).map_err(|_| {
                        backend(ZooKeeperLockError::ZooKeeper(zk::Error::UnexpectedError(
                            "a node created without a zxid".to_owned(),
                        )))
                    });
                }
                Ok(Err(zk::Error::NoNode)) => {
                    // Definitely not created: make the queue and try again.
                    in_flight.answered();
                    let queue = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
                    let sent = Instant::now();
                    match timeout_at(limit(sent), client.mkdir(&contender.path.queue, &queue)).await
                    {
                        Ok(Ok(())) => {}
                        Ok(Err(error)) => {
                            return Err(backend(ZooKeeperLockError::ZooKeeper(error)))
                        }
                        Err(_) => {
                            return Err(backend(ZooKeeperLockError::TimedOut("creating the queue")))
                        }
                    }
                }
                Ok(Err(error)) => return Err(backend(ZooKeeperLockError::ZooKeeper(error))),
                Err(_) => return Err(backend(ZooKeeperLockError::TimedOut("joining the queue"))),
            }
        }
        Err(backend(ZooKeeperLockError::ZooKeeper(zk::Error::NoNode)))
    }

    /// Reads the queue: whether the contender is first, or the node just older.
    async fn look(
        &self,
        contender: &Contender,
        limit: Instant,
        deadline: Instant,
    ) -> Result<Turn, LockError> {
        let client = contender
            .session
            .client()
            .ok_or_else(|| backend(ZooKeeperLockError::SessionLost))?;
        let children = match timeout_at(limit, client.list_children(&contender.path.queue)).await {
            Ok(Ok(children)) => children,
            Ok(Err(zk::Error::NoNode)) => return Err(backend(ZooKeeperLockError::NodeGone)),
            Ok(Err(error)) => return Err(backend(ZooKeeperLockError::ZooKeeper(error))),
            // Cut short by the wait (never the first look, which gets its own limit).
            Err(_) if limit == deadline => return Err(LockError::Timeout),
            Err(_) => return Err(backend(ZooKeeperLockError::TimedOut("reading the queue"))),
        };
        let mut queue: Vec<_> = children
            .iter()
            .filter_map(|name| parse_contender(name))
            .collect();
        queue.sort_unstable_by_key(|contender| contender.sequence);
        let Some(place) = queue.iter().position(|c| c.token == contender.token) else {
            return Err(backend(ZooKeeperLockError::NodeGone));
        };
        Ok(match place.checked_sub(1) {
            None => Turn::Ours,
            Some(before) => Turn::Behind(contender.path.child(queue[before].name)),
        })
    }
}

impl Inner {
    /// Deletes what `contender` may hold: its node, or every node of its token when the
    /// create's answer never came. One try.
    async fn delete_nodes(&self, contender: &Contender) -> GiveBack {
        let Some(client) = contender.session.client() else {
            // Lost: its nodes are gone or going with it.
            return GiveBack::Cleared;
        };
        let limit = Instant::now() + self.config.command_timeout;
        let nodes = match contender.node() {
            Some(node) => vec![node.to_owned()],
            None => match timeout_at(limit, client.list_children(&contender.path.queue)).await {
                Ok(Ok(children)) => children
                    .iter()
                    .filter_map(|name| parse_contender(name))
                    .filter(|c| c.token == contender.token)
                    .map(|c| contender.path.child(c.name))
                    .collect(),
                Ok(Err(zk::Error::NoNode)) => return GiveBack::NotOurs,
                _ => return GiveBack::NoAnswer,
            },
        };
        let mut outcome = GiveBack::NotOurs;
        for node in nodes {
            match timeout_at(limit, client.delete(&node, None)).await {
                Ok(Ok(())) => outcome = GiveBack::Cleared,
                Ok(Err(zk::Error::NoNode)) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, "ZooKeeper node delete failed");
                    return GiveBack::NoAnswer;
                }
                Err(_) => return GiveBack::NoAnswer,
            }
        }
        outcome
    }

    /// How long a give-back is retried: past it, the session is lost (unheard for a
    /// whole session timeout) or was heard while the deletes failed; then its nodes
    /// stay until it ends.
    pub(super) fn give_back_horizon(&self) -> Duration {
        4 * self.config.session_timeout + self.config.command_timeout
    }
}

/// The engine's in-flight guard and background give-back, on ZooKeeper nodes. A
/// contender's node lives as long as its session: there is no TTL to renew.
impl TtlBackend for Inner {
    type Target = Arc<Contender>;

    fn timing(&self) -> Timing {
        Timing::new(
            self.config.session_timeout,
            self.drift,
            self.config.command_timeout,
        )
        .renewal(false)
    }

    /// Never asked: ZooKeeper leases are not granted by the engine (`lease::grant`
    /// follows the session instead).
    async fn renew(
        &self,
        _contender: &Arc<Contender>,
        _token: &str,
        _ttl: Duration,
        _sent: Instant,
        _limit: Instant,
    ) -> Renewal {
        Renewal::Unknown
    }

    /// A lost session holds nothing: ZooKeeper deleted its nodes (expired) or will
    /// (closed, or abandoned when its local deadline passed).
    async fn try_give_back(&self, contender: &Arc<Contender>, _token: &str) -> GiveBack {
        if contender.session.is_lost() {
            return GiveBack::Cleared;
        }
        self.delete_nodes(contender).await
    }

    fn engine(&self) -> &'static str {
        "zookeeper"
    }

    fn give_back_until(&self, sent_at: Instant) -> Instant {
        sent_at + self.give_back_horizon()
    }
}
