//! Joining a lock's queue and waiting for the turn: the contender's node (ephemeral,
//! sequential, named with the acquisition's token), a watch on its predecessor only,
//! transient failures tried again within the wait (the node kept; the contender of a
//! session ZooKeeper expired queued again), and the give-back of a node nobody will
//! hold (ZooKeeper's steps of the `backend::ttl` engine's in-flight guard and
//! background give-back).

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::{sleep, sleep_until, timeout_at, Instant};
use zookeeper_client as zk;

use super::contender::Contender;
use super::keys::{self, parse_contender, LockPath};
use super::lease;
use super::session::Session;
use super::Inner;
use crate::backend::ttl::{
    self, fresh_token, jitter, Backoff, GiveBack, InFlight, Renewal, Timing, TtlBackend,
};
use crate::backend::Lease;
use crate::LockError;

/// How many times a create that found no queue node makes it and tries again: the
/// server deletes an empty queue (a container node) by itself, possibly in between.
const CREATE_ATTEMPTS: usize = 3;

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
    /// No session could be opened with the ensemble at `servers` (the connect string,
    /// without credentials).
    Unreachable {
        /// The connect string.
        servers: String,
        /// Why.
        error: zk::Error,
    },
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
            ZooKeeperLockError::Unreachable { servers, error } => {
                write!(f, "cannot reach ZooKeeper at {servers}: {error}")
            }
        }
    }
}

impl std::error::Error for ZooKeeperLockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ZooKeeperLockError::ZooKeeper(error)
            | ZooKeeperLockError::Unreachable { error, .. } => Some(error),
            _ => None,
        }
    }
}

pub(super) fn backend(error: ZooKeeperLockError) -> LockError {
    LockError::Backend(Box::new(error))
}

/// The first pause after a transient failure; pauses double from it (jittered) up to
/// the command timeout, and at most [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_secs(1);

/// Why a step of an acquisition did not go on.
enum Failure {
    /// No answer within the command timeout, the connection lost (a server died, the
    /// leader changed, a path reset) or the server throttled: worth another try within
    /// the wait. The contender keeps its node, and so its place.
    Transient(ZooKeeperLockError),
    /// The session ended while ZooKeeper could be reached (it said the session
    /// expired, the client was connected again when the session was declared lost, or
    /// this process stalled past the session's deadline with no heartbeat unanswered):
    /// the contender's node went with it. A new session may queue again within the
    /// wait.
    SessionExpired,
    /// The session ended with ZooKeeper out of reach (unheard past its local deadline,
    /// its heartbeats unanswered; or closed): the acquisition queues again on a new
    /// session once one opens within the wait.
    SessionLost,
    /// The wait ended.
    WaitOver,
    /// Anything else: the acquisition fails with it.
    Definite(LockError),
}

impl Failure {
    /// Sorts ZooKeeper's answer: only what the server said about the request itself
    /// is definite.
    fn of(error: zk::Error) -> Self {
        match error {
            // `Custom` carries the connection's own failures (a reset, no answer on it).
            zk::Error::ConnectionLoss
            | zk::Error::Timeout
            | zk::Error::Throttled
            | zk::Error::Custom(_) => Failure::Transient(ZooKeeperLockError::ZooKeeper(error)),
            zk::Error::SessionExpired | zk::Error::SessionMoved => Failure::SessionExpired,
            zk::Error::ClientClosed | zk::Error::NoHosts => Failure::SessionLost,
            error => Failure::Definite(backend(ZooKeeperLockError::ZooKeeper(error))),
        }
    }
}

/// One acquisition's budget: its wait, the pauses between its tries, and the last
/// transient failure (what it fails with if the wait ends before ZooKeeper answers
/// again).
struct Attempt {
    deadline: Instant,
    command_timeout: Duration,
    /// Whether ZooKeeper answered a read of the queue yet: until then every request
    /// gets a whole command timeout, so that a wait of zero still tries once (joins and
    /// looks).
    looked: bool,
    backoff: Backoff,
    failing: Option<ZooKeeperLockError>,
    /// Whether the acquisition queued behind another contender or tried a step again:
    /// its grant was contended.
    contended: bool,
}

impl Attempt {
    fn new(wait: Duration, command_timeout: Duration) -> Self {
        Attempt {
            deadline: ttl::deadline_after(wait),
            command_timeout,
            looked: false,
            backoff: Self::backoff(command_timeout),
            failing: None,
            contended: false,
        }
    }

    fn backoff(command_timeout: Duration) -> Backoff {
        Backoff::new(RETRY_FIRST, command_timeout.clamp(RETRY_FIRST, RETRY_MAX))
    }

    /// When the next request on `session` must be answered: a command timeout from
    /// now, cut short by the session's deadline (past it, the session is lost whatever
    /// the answer), and by the end of the wait once the queue was read.
    fn limit(&self, session: &Session) -> Instant {
        let limit = (Instant::now() + self.command_timeout).min(session.health().valid_until);
        if self.looked {
            limit.min(self.deadline)
        } else {
            limit
        }
    }

    /// A request whose `limit` passed unanswered.
    fn timed_out(&self, limit: Instant, step: &'static str) -> Failure {
        if limit == self.deadline {
            Failure::WaitOver
        } else {
            Failure::Transient(ZooKeeperLockError::TimedOut(step))
        }
    }

    /// ZooKeeper answered a read of the queue: the failures before are over.
    fn heard(&mut self) {
        self.looked = true;
        self.failing = None;
        self.backoff = Self::backoff(self.command_timeout);
    }

    fn wait_is_over(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Pauses (jittered, growing) before another try after `error`; when no time is
    /// left for one, fails with it at once, before the wait ends.
    async fn pause(&mut self, error: ZooKeeperLockError) -> Result<(), Failure> {
        let pause = self.backoff.pause();
        if Instant::now() + pause >= self.deadline {
            return Err(Failure::Definite(backend(error)));
        }
        tracing::debug!(%error, ?pause, "ZooKeeper step failed; tried again within the wait");
        self.failing = Some(error);
        self.contended = true;
        sleep(pause).await;
        Ok(())
    }

    /// What an acquisition whose wait ended fails with: the transient failure it was
    /// going through, if any; else a plain timeout.
    fn wait_over(&mut self) -> LockError {
        self.failing.take().map_or(LockError::Timeout, backend)
    }
}

/// How long opening a session may take.
#[derive(Clone, Copy)]
enum Connect {
    /// The acquisition's first: the whole connect timeout, so that a wait of zero
    /// still tries once.
    First,
    /// After a failure: within the wait.
    Again,
}

/// What one look at the queue found.
enum Turn {
    /// No older contender: the lock is ours.
    Ours,
    /// The newest older contender's node.
    Behind(String),
}

impl Inner {
    /// Queues for `path` until granted or the wait ends. A transient failure is tried
    /// again (the node, and so its place, kept) as long as the session lives; a session
    /// that ended took the node along: the acquisition queues again on a new session,
    /// at the back. Opening one is tried again too, until the wait ends: the backend
    /// reached ZooKeeper when it was built, so an ensemble out of reach now is an outage
    /// to ride out within the wait (DESIGN rule 11), not a setup error.
    pub(super) async fn acquire(
        self: Arc<Self>,
        path: LockPath,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let mut attempt = Attempt::new(wait, self.config.settings.command_timeout);
        let mut connect = Connect::First;
        loop {
            let failure = match self.session_within(&attempt, connect).await {
                Ok(session) => match self.clone().queue(&path, session, &mut attempt).await {
                    Ok(lease) => return Ok(lease),
                    Err(failure) => failure,
                },
                Err(failure) => failure,
            };
            connect = Connect::Again;
            let error = match failure {
                Failure::Transient(error) => error,
                // Queue again on a new session.
                Failure::SessionExpired | Failure::SessionLost => ZooKeeperLockError::SessionLost,
                Failure::WaitOver => return Err(attempt.wait_over()),
                Failure::Definite(error) => return Err(error),
            };
            match attempt.pause(error).await {
                Ok(()) => {}
                Err(Failure::Definite(error)) => return Err(error),
                Err(_) => return Err(attempt.wait_over()),
            }
        }
    }

    /// The session to queue on, bounded as `connect` says.
    async fn session_within(
        &self,
        attempt: &Attempt,
        connect: Connect,
    ) -> Result<Arc<Session>, Failure> {
        match connect {
            Connect::First => self.session().await.map_err(Failure::Transient),
            Connect::Again => match timeout_at(attempt.deadline, self.session()).await {
                Ok(session) => session.map_err(Failure::Transient),
                Err(_) => Err(Failure::WaitOver),
            },
        }
    }

    /// One contender on `session`: its node, then its turn.
    async fn queue(
        self: Arc<Self>,
        path: &LockPath,
        session: Arc<Session>,
        attempt: &mut Attempt,
    ) -> Result<Lease, Failure> {
        let token = fresh_token().map_err(Failure::Definite)?;
        let contender = Arc::new(Contender {
            session: session.clone(),
            path: path.clone(),
            token: token.clone(),
            node: OnceLock::new(),
        });
        // Armed from the create on: dropping it (an error, the wait over, the future
        // dropped at any await) deletes the contender's node, found by its token if the
        // create's answer never came.
        let mut in_flight = InFlight::new(self.clone(), contender.clone(), token);
        let outcome = match self.join(&contender, &mut in_flight, attempt).await {
            Ok(fence) => self.wait_turn(&contender, attempt).await.map(|()| fence),
            Err(failure) => Err(failure),
        };
        match outcome {
            Ok(fence) => {
                let Some(lease) = lease::grant(&self, contender, fence) else {
                    return Err(Failure::SessionLost);
                };
                in_flight.granted();
                Ok(lease.with_contention(attempt.contended))
            }
            Err(failure @ (Failure::SessionLost | Failure::SessionExpired)) => {
                // Never used again: the next try opens a new session. ZooKeeper was in
                // reach if it said the session expired, if the client was connected
                // again when the session was declared lost, or if no heartbeat went
                // unanswered (the deadline passed while this process stalled).
                session.lose();
                let health = session.health();
                let in_reach = matches!(failure, Failure::SessionExpired)
                    || health.expired
                    || health.connected_when_lost
                    || !health.unanswered;
                Err(if in_reach {
                    Failure::SessionExpired
                } else {
                    Failure::SessionLost
                })
            }
            Err(failure) => Err(failure),
        }
    }

    /// Waits until no contender in the queue is older than the contender's node.
    /// Transient failures are tried again here, keeping the node.
    async fn wait_turn(&self, contender: &Contender, attempt: &mut Attempt) -> Result<(), Failure> {
        let session = &contender.session;
        loop {
            if session.is_lost() {
                return Err(Failure::SessionLost);
            }
            let predecessor = match self.look(contender, attempt).await {
                Ok(Turn::Ours) => return Ok(()),
                Ok(Turn::Behind(predecessor)) => {
                    attempt.contended = true;
                    predecessor
                }
                Err(Failure::Transient(error)) => {
                    attempt.pause(error).await?;
                    continue;
                }
                Err(failure) => return Err(failure),
            };
            attempt.heard();
            if attempt.wait_is_over() {
                return Err(Failure::WaitOver);
            }
            let watcher = match self.watch(contender, &predecessor, attempt).await {
                Ok(Some(watcher)) => watcher,
                // Gone already: look again.
                Ok(None) => continue,
                Err(Failure::Transient(error)) => {
                    attempt.pause(error).await?;
                    continue;
                }
                Err(failure) => return Err(failure),
            };
            tokio::select! {
                biased;
                () = sleep_until(attempt.deadline) => return Err(Failure::WaitOver),
                () = session.lost() => return Err(Failure::SessionLost),
                // Deleted (released, its session ended), or any other event: look again.
                _ = watcher.changed() => {}
                // The backstop for a watch that never fires.
                () = sleep(jitter(self.config.settings.poll_interval)) => {}
            }
        }
    }

    /// Creates the contender's node (and the queue's nodes if missing); returns its
    /// fencing token, the node's creation zxid. After a create whose answer never
    /// came, the node is looked for by its token before another create, so that a
    /// contender has one node.
    async fn join(
        &self,
        contender: &Contender,
        in_flight: &mut InFlight<Inner>,
        attempt: &mut Attempt,
    ) -> Result<u64, Failure> {
        let client = contender.session.client().ok_or(Failure::SessionLost)?;
        let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        let prefix = contender.path.contender_prefix(&contender.token);
        let mut unanswered = false;
        let mut queue_made = 0;
        loop {
            if contender.session.is_lost() {
                return Err(Failure::SessionLost);
            }
            if unanswered {
                match self.find(contender, &client, attempt).await {
                    Ok(Some((node, fence))) => {
                        let _ = contender.node.set(node);
                        return Ok(fence);
                    }
                    Ok(None) => {}
                    Err(Failure::Transient(error)) => {
                        attempt.pause(error).await?;
                        continue;
                    }
                    Err(failure) => return Err(failure),
                }
            }
            let limit = attempt.limit(&contender.session);
            in_flight.sent(Instant::now());
            let created = timeout_at(
                limit,
                client.create(
                    &prefix,
                    self.config.settings.instance_id.as_bytes(),
                    &ephemeral,
                ),
            )
            .await;
            let failure = match created {
                Ok(Ok((stat, sequence))) => {
                    let _ = contender.node.set(format!("{prefix}{sequence}"));
                    return fence_of(&stat);
                }
                Ok(Err(zk::Error::NoNode)) if queue_made < CREATE_ATTEMPTS => {
                    // Definitely not created: make the queue (the server deletes an
                    // empty one by itself, possibly in between) and try again.
                    in_flight.answered();
                    unanswered = false;
                    queue_made += 1;
                    match self.make_queue(contender, &client, attempt).await {
                        Ok(()) => continue,
                        Err(failure) => failure,
                    }
                }
                Ok(Err(error)) => {
                    unanswered = true;
                    Failure::of(error)
                }
                Err(_) => {
                    unanswered = true;
                    attempt.timed_out(limit, "joining the queue")
                }
            };
            match failure {
                Failure::Transient(error) => attempt.pause(error).await?,
                failure => return Err(failure),
            }
        }
    }

    /// Creates the queue's nodes (containers).
    async fn make_queue(
        &self,
        contender: &Contender,
        client: &zk::Client,
        attempt: &mut Attempt,
    ) -> Result<(), Failure> {
        let queue = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
        let limit = attempt.limit(&contender.session);
        match timeout_at(limit, client.mkdir(&contender.path.queue, &queue)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(Failure::of(error)),
            Err(_) => Err(attempt.timed_out(limit, "creating the queue")),
        }
    }

    /// The node a create of the contender made although its answer never came, with
    /// its fencing token: the oldest of its token (a later one, if any, is deleted by
    /// [`look`](Self::look)). Read on the session that sent the create, so after it.
    async fn find(
        &self,
        contender: &Contender,
        client: &zk::Client,
        attempt: &mut Attempt,
    ) -> Result<Option<(String, u64)>, Failure> {
        let limit = attempt.limit(&contender.session);
        let step = "looking for the node of an unanswered create";
        let children = match timeout_at(limit, client.list_children(&contender.path.queue)).await {
            Ok(Ok(children)) => children,
            Ok(Err(zk::Error::NoNode)) => return Ok(None),
            Ok(Err(error)) => return Err(Failure::of(error)),
            Err(_) => return Err(attempt.timed_out(limit, step)),
        };
        let Some(mine) = children
            .iter()
            .filter_map(|name| parse_contender(name))
            .filter(|c| c.token == contender.token)
            .min_by_key(|c| c.sequence)
        else {
            return Ok(None);
        };
        let node = contender.path.child(mine.name);
        match timeout_at(limit, client.check_stat(&node)).await {
            Ok(Ok(Some(stat))) => Ok(Some((node, fence_of(&stat)?))),
            // Only this contender deletes its node: none left means none made.
            Ok(Ok(None)) => Ok(None),
            Ok(Err(error)) => Err(Failure::of(error)),
            Err(_) => Err(attempt.timed_out(limit, step)),
        }
    }

    /// Reads the queue: whether the contender is first, or the node just older.
    async fn look(&self, contender: &Contender, attempt: &mut Attempt) -> Result<Turn, Failure> {
        let client = contender.session.client().ok_or(Failure::SessionLost)?;
        let limit = attempt.limit(&contender.session);
        let node_gone = || {
            if contender.session.is_lost() {
                Failure::SessionLost
            } else {
                Failure::Definite(backend(ZooKeeperLockError::NodeGone))
            }
        };
        let children = match timeout_at(limit, client.list_children(&contender.path.queue)).await {
            Ok(Ok(children)) => children,
            Ok(Err(zk::Error::NoNode)) => return Err(node_gone()),
            Ok(Err(error)) => return Err(Failure::of(error)),
            Err(_) => return Err(attempt.timed_out(limit, "reading the queue")),
        };
        let mut queue: Vec<_> = children
            .iter()
            .filter_map(|name| parse_contender(name))
            .collect();
        queue.sort_unstable_by_key(|contender| contender.sequence);
        // The contender's node: the one its create was answered with, or found by its
        // token.
        let mine = |c: &&keys::Contender<'_>| match contender.node() {
            Some(node) => node.rsplit('/').next() == Some(c.name),
            None => c.token == contender.token,
        };
        if !queue.iter().any(|c| mine(&c)) {
            return Err(node_gone());
        }
        // A create retried after its answer was lost may have made a second node of the
        // token: it would hold up everyone behind it, so it goes.
        let (extra, queue): (Vec<_>, Vec<_>) = queue
            .into_iter()
            .partition(|c| c.token == contender.token && !mine(&c));
        for node in extra {
            let _ = timeout_at(limit, client.delete(&contender.path.child(node.name), None)).await;
        }
        let place = queue.iter().position(|c| mine(&c)).unwrap_or_default();
        Ok(match place.checked_sub(1) {
            None => Turn::Ours,
            Some(before) => Turn::Behind(contender.path.child(queue[before].name)),
        })
    }

    /// Watches `predecessor`: `None` if it is gone already.
    async fn watch(
        &self,
        contender: &Contender,
        predecessor: &str,
        attempt: &mut Attempt,
    ) -> Result<Option<zk::OneshotWatcher>, Failure> {
        let client = contender.session.client().ok_or(Failure::SessionLost)?;
        let limit = attempt.limit(&contender.session);
        match timeout_at(limit, client.check_and_watch_stat(predecessor)).await {
            Ok(Ok((Some(_), watcher))) => Ok(Some(watcher)),
            Ok(Ok((None, _))) => Ok(None),
            Ok(Err(error)) => Err(Failure::of(error)),
            Err(_) => Err(attempt.timed_out(limit, "watching the predecessor")),
        }
    }
}

/// The fencing token of a contender's node: its creation zxid.
fn fence_of(stat: &zk::Stat) -> Result<u64, Failure> {
    u64::try_from(stat.czxid).map_err(|_| {
        Failure::Definite(backend(ZooKeeperLockError::ZooKeeper(
            zk::Error::UnexpectedError("a node created without a zxid".to_owned()),
        )))
    })
}

impl Inner {
    /// Deletes what `contender` may hold: its node, or every node of its token when the
    /// create's answer never came. One try.
    async fn delete_nodes(&self, contender: &Contender) -> GiveBack {
        let Some(client) = contender.session.client() else {
            // Lost: its nodes are gone or going with it.
            return GiveBack::Cleared;
        };
        let limit = Instant::now() + self.config.settings.command_timeout;
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
        4 * self.config.settings.lease + self.config.settings.command_timeout
    }
}

/// The engine's in-flight guard and background give-back, on ZooKeeper nodes. A
/// contender's node lives as long as its session: there is no TTL to renew.
impl TtlBackend for Inner {
    type Target = Arc<Contender>;

    fn timing(&self) -> Timing {
        // The session, kept alive by the client, is what a ZooKeeper hold lasts by.
        self.config.settings.timing().renewal(false)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_servers_refusals_are_definite() {
        let transient = [
            zk::Error::ConnectionLoss,
            zk::Error::Timeout,
            zk::Error::Throttled,
        ];
        for error in transient {
            assert!(
                matches!(Failure::of(error.clone()), Failure::Transient(_)),
                "{error}"
            );
        }
        for error in [zk::Error::SessionExpired, zk::Error::SessionMoved] {
            assert!(
                matches!(Failure::of(error.clone()), Failure::SessionExpired),
                "{error}"
            );
        }
        for error in [zk::Error::ClientClosed, zk::Error::NoHosts] {
            assert!(
                matches!(Failure::of(error.clone()), Failure::SessionLost),
                "{error}"
            );
        }
        for error in [zk::Error::NoNode, zk::Error::NoAuth, zk::Error::InvalidAcl] {
            assert!(
                matches!(Failure::of(error.clone()), Failure::Definite(_)),
                "{error}"
            );
        }
    }

    #[test]
    fn a_wait_fails_with_what_it_was_going_through() {
        let mut attempt = Attempt::new(Duration::ZERO, Duration::from_millis(500));
        assert!(matches!(attempt.wait_over(), LockError::Timeout));
        attempt.failing = Some(ZooKeeperLockError::TimedOut("reading the queue"));
        let error = attempt.wait_over().to_string();
        assert!(error.contains("reading the queue"), "{error}");
    }
}
