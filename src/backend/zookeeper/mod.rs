//! ZooKeeper backend: serializes a key across every instance that shares a ZooKeeper
//! ensemble, with an ephemeral sequential node per contender, waiters queued in
//! arrival order across instances (each watching only its predecessor), and the node's
//! creation zxid as fencing token.
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_keyed_lock::backend::{zookeeper::ZooKeeperBackend, SetupError};
//! use tower_keyed_lock::{DistributedLocks, KeyedLockLayer};
//!
//! # async fn run() -> Result<(), SetupError> {
//! let backend = ZooKeeperBackend::builder("zk-0:2181,zk-1:2181,zk-2:2181")
//!     .lease(Duration::from_secs(10))
//!     .build()
//!     .await?;
//! // Requests with one idempotency key run one at a time, across every instance…
//! let layer = KeyedLockLayer::by_header("idempotency-key")
//!     .name("orders")
//!     .wait_timeout(Duration::from_secs(2))
//!     .backend(backend.clone());
//! // …and so do jobs, outside HTTP.
//! let jobs = DistributedLocks::builder("jobs").backend(backend).build();
//! if let Ok(guard) = jobs.try_lock("nightly-report").await {
//!     // Only this instance runs it; `guard.fencing_token()` orders its writes.
//!     guard.release().await;
//! }
//! # let _ = layer;
//! # Ok(())
//! # }
//! ```
//!
//! The client is [`zookeeper_client`] (kezhuw's `zookeeper-client`): written for async
//! Rust from the protocol up and kept current with ZooKeeper (`create2`, which answers
//! with the new node's `Stat` and so its creation zxid; container nodes; `sync`;
//! connect strings of several servers), with one-shot watches that are plain futures,
//! a session state watcher, and a Curator-compatible lock recipe of its own to compare
//! with. Of the alternatives, `tokio-zookeeper` connects to one server address (no
//! failover within an ensemble) and has no `sync`; `zookeeper-async` has no `sync`
//! either and delivers watches to callbacks, after the 3.4-era Java client it follows.
//! `sync` is what the heartbeat needs (see below): it goes through the leader.
//!
//! # ZooKeeper nodes
//!
//! A layer named `name` locks request key `key` with these nodes:
//!
//! ```text
//! <prefix>/<name>/<key>                          the lock's queue (container nodes,
//!                                                which ZooKeeper deletes once empty)
//! <prefix>/<name>/<key>/_c_<token>-lock-<seq>    one contender (holder or waiter):
//!                                                ephemeral sequential, empty
//! ```
//!
//! `name` and `key` are each written with every byte outside ASCII letters, digits and
//! `- _ ~ : @ + = ,` escaped as `%XX` (so `/`, `.`, `%`, `#`, spaces, control and
//! non-ASCII characters never appear raw, nor the names `.` and `..`); `zookeeper` is
//! written `%7Aookeeper`. When the escaped form is empty or longer than 128 bytes, it is
//! `#` followed by the lowercase hex SHA-256 of the UTF-8 bytes instead (stable across
//! builds and machines). Distinct (name, key) pairs under one prefix never share a
//! queue. `<token>` is 128 random bits in hex, fresh for every acquisition; `<seq>` is
//! ZooKeeper's sequence number. The prefix (default [`DEFAULT_PREFIX`],
//! `"/keyed-lock"`) gets a leading `/` and loses trailing ones; a prefix under
//! `/zookeeper`, or with empty, `.` or `..` parts, is refused.
//! [`ZooKeeperBackend::queue_path`] computes a queue's path.
//!
//! # How a key is held
//!
//! This is ZooKeeper's lock recipe (the one Curator's `InterProcessMutex` follows),
//! with its timing made explicit:
//!
//! - **Session.** The backend keeps one ZooKeeper session (opened on first use, with
//!   [`lease`](ZooKeeperBackendBuilder::lease), the session timeout); every contender's
//!   node belongs to it and goes when it ends.
//! - **Queue.** An acquisition creates its node, ephemeral and sequential, named with
//!   its token ("protected", as Curator calls it). The sequence number is its place in
//!   the queue; if no contender of the queue is older, the lock is granted. Within an
//!   instance, requests for a key queue on the local table first (the two tiers of
//!   [`backend`](crate::backend)), so an instance has at most one node in a key's queue.
//! - **Wait.** Otherwise the waiter watches the node just older than its own (its
//!   predecessor only: one release wakes one waiter, no herd) and reads the queue again
//!   when the watch fires, or after a jittered
//!   [`poll_interval`](ZooKeeperBackendBuilder::poll_interval) (a backstop: a lost
//!   watch only costs latency). Keys pass in FIFO order across instances.
//! - **Only the wait bounds the waiting.** A step that fails for a while — no answer
//!   within the command timeout, the connection lost (a server died, the leader
//!   changed, the path was reset), the server throttling — is tried again after a
//!   jittered pause (10–20 ms, doubling up to the command timeout, at most 1 s) within
//!   the request's wait, and the waiter keeps its node, so its place. A create whose
//!   answer never came is looked for by its token before another is sent. A session
//!   that ended while ZooKeeper could be reached (expired by ZooKeeper, or past its
//!   local deadline while this process stalled) took the waiter's node with it: the
//!   waiter queues again on a new session (at the back), still within its wait; so
//!   does one whose session was lost with its heartbeats unanswered, and opening that
//!   session is tried again as long as the wait lasts (the backend reached the
//!   ensemble when it was built: an ensemble out of reach now is an outage). What ends
//!   a wait early is the server's own refusals (no such node, not authorized, …).
//! - **Fencing token.** The holder node's creation zxid
//!   ([`LockInfo::fencing_token`](crate::LockInfo::fencing_token)): one counter for the
//!   whole ensemble, raised by every write and by every new leader's epoch, so strictly
//!   increasing from holder to holder.
//! - **Validity.** A heartbeat (`sync`, which goes through the leader) every third of
//!   the session timeout. The session, and every lease on it, counts as alive until
//!   *send time of the heartbeat before the last answered one + session timeout −
//!   drift margin*, on the monotonic clock: a follower passes a session's touches to
//!   the leader on its next ping, so the last heartbeat may not have reached the leader
//!   when the link broke, while the one before it has. At that instant the session is
//!   declared lost (whatever ZooKeeper says later), as it is at once when the client
//!   reports it expired or closed, and a holder's lease is lost too when a watch on its
//!   own node sees it deleted. The handler sees it through
//!   [`LockInfo::lease`](crate::LockInfo::lease). A session declared lost is closed
//!   (its nodes go at once if ZooKeeper can still be reached) and the next acquisition
//!   opens a new one.
//! - **Release.** The node is deleted: the next waiter's watch fires. If ZooKeeper
//!   cannot be reached within the command timeout, the delete is retried in the
//!   background until it succeeds or the session is lost.
//! - **Cancel safety.** From the create on, a guard deletes the contender's node if the
//!   acquisition ends without handing it over (an error, the wait over, the acquire
//!   future dropped at any await). When the create's answer never came, the guard finds
//!   the node by its token among the queue's children, and looks again until no write
//!   of the attempt can still land.
//!
//! Every request is bounded by
//! [`command_timeout`](ZooKeeperBackendBuilder::command_timeout): when ZooKeeper is down
//! or silent, an acquisition fails with [`LockError::Backend`] (the last failure) when
//! its wait ends or its session is lost unheard and no new one opens, whichever is
//! first (at once for a try without a wait; within a session timeout and a command
//! timeout for a wait without limit), and the layer answers
//! 503 (or runs the request under its local lock with
//! [`fail_open`](crate::KeyedLockLayer::fail_open)). An acquisition whose wait ends
//! while ZooKeeper answers gets [`LockError::Timeout`].
//!
//! # Who holds a key
//!
//! [`holder`](LockBackend::holder) syncs its session's server with the leader (a
//! follower may lag behind a grant another instance already saw), then lists the key's
//! queue and reads its first node: the holder. Each contender's node carries its instance id
//! ([`instance_id`](ZooKeeperBackendBuilder::instance_id)) as its data, written by the
//! create that joins the queue; its creation zxid is the fencing token. `since` is the
//! node's `ctime` (the server's clock), when the holder *joined the queue*: for a
//! holder that waited behind others, earlier than its grant, which ZooKeeper records
//! nowhere. No lease is left to tell (the lock lasts as long as the session):
//! `lease_left` is `None`.
//!
//! # Timing rules
//!
//! | what | when |
//! |---|---|
//! | heartbeat (`sync`) | every session timeout/3 after the last one sent; retried every timeout/12 while unanswered |
//! | a holder counts its lease lost | send time of the heartbeat before the last answered one + session timeout − drift margin (default 1% of the timeout + 2 ms); at once when the session is reported expired or closed, or its node is seen deleted |
//! | ZooKeeper frees a stopped holder's node | one negotiated session timeout after the leader last heard of the session (rounded up to a tick); a new leader restarts every session's timeout |
//! | one request (create, read, watch, delete, heartbeat) | at most the command timeout (default 1 s) |
//! | opening a session | at most the command timeout per server in the connect string |
//! | a waiter looks again without a watch event | after a jittered poll interval (default 1 s) |
//! | a step that failed for a while is tried again | after 10–20 ms, each pause doubling up to the command timeout (at most 1 s), jittered; within the wait, while the session lives |
//!
//! # Failures of the ensemble
//!
//! Creates, deletes and `sync` need a quorum. When the leader dies, the ensemble elects
//! another (within a few ticks) and every session's timeout starts again; the client
//! reconnects to another server of the connect string within the session, and the
//! heartbeats get through again. Waiters keep their place meanwhile: their reads and
//! watches that fail during the election are tried again. A holder cut off from the quorum (its server in a
//! minority partition, a majority of servers down, the link silent) cannot get a
//! heartbeat answered; it is told at its local deadline, before the leader (whose count
//! starts later) expires the session and deletes its node. A server restarted rejoins
//! with its data.
//!
//! # What this backend does not guarantee
//!
//! - **Clock rate.** Validity is a duration measured on two clocks (this process's and
//!   the leader's); the drift margin must cover how much faster this clock can run than
//!   the leader's over one session timeout. Wall clocks are never compared.
//! - **A stalled holder.** A holder whose process pauses past its session timeout loses
//!   the key to the next waiter; it learns it from
//!   [`LeaseSignal::is_lost`](crate::LeaseSignal::is_lost) at its next look (by the
//!   clock alone), not before. Use the fencing token where a late write must be refused.
//! - **One session for all keys.** Every lock of one backend shares its session: a
//!   session lost loses every lease held on it at once.
//! - **Restores and data loss.** Fencing tokens are zxids. An ensemble restored from an
//!   old snapshot, or one that lost acknowledged writes (`forceSync=no` and every server
//!   restarted), can issue a zxid issued before.
//! - **Nodes deleted by hand.** An operator's delete of a holder's node grants the lock
//!   to the next waiter at once; the holder learns it when its node watch fires (one
//!   round trip later). Keep the prefix away from other writers (ZooKeeper ACLs can).
//! - **A delete that keeps failing while the session lives.** Such a node stays until
//!   the session ends (the backend dropped, or the session lost).
//! - **Shared holders and permits.** Not built yet: one holder per key. The recipes map
//!   onto the same queue: a shared lock is a read node that waits only for older write
//!   nodes (a writer waits for every older node); n permits grant the n oldest nodes,
//!   each waiter watching the node n places ahead of it.
//!
//! # Unsafe setups refused
//!
//! [`build`](ZooKeeperBackendBuilder::build) opens a session (and closes it again: the
//! first acquisition opens the one the locks use, on the runtime it runs on, so that a
//! process whose runtime stalls or dies takes its session along) and refuses, with a
//! [`SetupError::Unsafe`] that names the problem:
//!
//! - a drift margin of half the negotiated session timeout or more (no validity would
//!   be left; the server may shorten the timeout asked to its own bounds, 2 to 20
//!   ticks);
//! - a prefix that is not a valid ZooKeeper path, or lies under `/zookeeper`.
//!
//! The backend never connects read-only (a read-only server cannot create nodes) and
//! never reads a lock's queue without the session's ordering (every read follows the
//! contender's own create on the same session).

// One concern per file: `keys` names the nodes, `session` keeps the session heard,
// `acquire` queues and waits (and gives back a node nobody holds), `lease` follows a
// held node, `holder` reads the first node of a queue. This file has the public types
// and their configuration.
mod acquire;
mod config;
mod contender;
mod deployment;
mod holder;
mod keys;
mod lease;
mod session;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex as AsyncMutex;

use self::config::Config;
use self::keys::{check_prefix, normalize_prefix, LockPath};
use self::session::Session;
use super::settings::{self, Defaults, Settings};
use super::SetupError;
use super::{Acquisition, BoxFuture, Holder, LockBackend};
use crate::error::LockError;
use crate::key::Key;

pub use self::acquire::ZooKeeperLockError;

/// The default [`ZooKeeperBackendBuilder::lease`]: the session timeout asked.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// The shortest lease (session timeout) asked; ZooKeeper keeps it between 2 and 20 of
/// its ticks.
pub const MIN_LEASE: Duration = Duration::from_millis(100);
/// The default [`ZooKeeperBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);
/// The default [`ZooKeeperBackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// The default [`ZooKeeperBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "/keyed-lock";

/// A [`LockBackend`] on a ZooKeeper ensemble (3.5 or newer): one session, shared by
/// every clone. See the [module docs](self).
///
/// ```no_run
/// use tower_keyed_lock::backend::zookeeper::ZooKeeperBackend;
/// use tower_keyed_lock::KeyedLockLayer;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = ZooKeeperBackend::connect("127.0.0.1:2181").await?;
/// let layer = KeyedLockLayer::by_header("idempotency-key")
///     .name("deliveries")
///     .backend(backend);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

/// Configures a [`ZooKeeperBackend`]; made by [`ZooKeeperBackend::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::zookeeper::ZooKeeperBackend;
///
/// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
/// let backend = ZooKeeperBackend::builder("127.0.0.1:2181")
///     .lease(Duration::from_secs(6))
///     .command_timeout(Duration::from_millis(500))
///     .prefix("/billing/locks")
///     .build()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ZooKeeperBackendBuilder {
    config: Config,
}

/// What every clone of a backend shares.
struct Inner {
    /// With the lease the session timeout ZooKeeper granted.
    config: Config,
    /// The session in use; replaced by the next acquisition once lost.
    session: AsyncMutex<Option<Arc<Session>>>,
}

/// ZooKeeper's defaults and limits.
static DEFAULTS: Defaults = settings::defaults!("ZooKeeper", node_prefix);

/// A prefix as node paths start with it: a leading `/` added, trailing ones removed,
/// not under `/zookeeper`, without empty, `.` or `..` parts.
fn node_prefix(prefix: &str) -> Result<String, String> {
    let prefix = normalize_prefix(prefix);
    check_prefix(&prefix)?;
    Ok(prefix)
}

impl Config {
    /// The connect string as errors show it: any `user:password@` before a host left
    /// out (ZooKeeper's connect strings carry none, but a pasted URL might).
    fn shown_servers(&self) -> String {
        self.servers
            .split(',')
            .map(|server| match server.split_once('@') {
                Some((user, host)) if !user.contains('/') => host,
                _ => server,
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How long opening a session may take: the command timeout per server.
    fn connect_timeout(&self) -> Duration {
        let servers = self.servers.split(',').count().max(1);
        self.settings.command_timeout * u32::try_from(servers).unwrap_or(u32::MAX)
    }
}

impl ZooKeeperBackend {
    /// A builder for a backend on the ensemble at `servers`, a ZooKeeper connect string
    /// (`host:port,host:port,…`; every server of the ensemble lets the client go on
    /// when one is down).
    pub fn builder(servers: impl Into<String>) -> ZooKeeperBackendBuilder {
        ZooKeeperBackendBuilder {
            config: Config {
                servers: servers.into(),
                settings: Settings::new(&DEFAULTS),
                asked: DEFAULTS.lease,
            },
        }
    }

    /// A backend with the defaults, on the ensemble at `servers`.
    pub async fn connect(servers: impl Into<String>) -> Result<Self, SetupError> {
        Self::builder(servers).build().await
    }

    /// The path of the queue of `key` for the layer called `name` (see
    /// [ZooKeeper nodes](self#zookeeper-nodes)): every contender's node is a child of
    /// it.
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::zookeeper::ZooKeeperBackend;
    /// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
    /// # let backend = ZooKeeperBackend::connect("127.0.0.1:2181").await?;
    /// assert_eq!(backend.queue_path("orders", "42"), "/keyed-lock/orders/42");
    /// assert_eq!(backend.queue_path("orders", "a/b"), "/keyed-lock/orders/a%2Fb");
    /// # Ok(())
    /// # }
    /// ```
    pub fn queue_path(&self, name: &str, key: &str) -> String {
        LockPath::new(&self.inner.config.settings.prefix, name, key).queue
    }

    /// The session timeout the ensemble granted (it may shorten or lengthen the one
    /// asked to its own bounds).
    pub fn session_timeout(&self) -> Duration {
        self.inner.config.settings.lease
    }
}

impl fmt::Debug for ZooKeeperBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZooKeeperBackend")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl ZooKeeperBackendBuilder {
    // No `renewal`: the client keeps the session alive, and the session is the lease.
    settings::lease_settings!(config.settings; instance_id lease drift_margin command_timeout poll_interval prefix);

    /// Opens a session to check the setup (see
    /// [Unsafe setups refused](self#unsafe-setups-refused)).
    pub async fn build(self) -> Result<ZooKeeperBackend, SetupError> {
        let mut config = Config {
            settings: self.config.settings.check()?,
            ..self.config
        };
        let session = Session::open(&config)
            .await
            .map_err(|error| SetupError::failed(DEFAULTS.engine, config.shown_servers(), error))?;
        let negotiated = session.timeout();
        let drift = config.settings.drift();
        if drift >= negotiated / 2 {
            return Err(SetupError::Invalid(format!(
                "the drift margin {drift:?} is half the session timeout ZooKeeper granted \
                 ({negotiated:?}, asked {:?}) or more",
                config.settings.lease
            )));
        }
        config.asked = config.settings.lease;
        config.settings.lease = negotiated;
        // Closed: the first acquisition opens the session the locks use, so that its
        // tasks run on the runtime the locks are used from (a process whose runtime
        // stalls or dies takes its session with it, as it should).
        drop(session);
        Ok(ZooKeeperBackend {
            inner: Arc::new(Inner {
                config,
                session: AsyncMutex::new(None),
            }),
        })
    }
}

impl Inner {
    /// The session in use, or a new one if it is lost (or none was open).
    async fn session(&self) -> Result<Arc<Session>, ZooKeeperLockError> {
        let mut slot = self.session.lock().await;
        if let Some(session) = slot.as_ref().filter(|session| !session.is_lost()) {
            return Ok(session.clone());
        }
        *slot = None;
        let session =
            Session::open(&self.config)
                .await
                .map_err(|error| ZooKeeperLockError::Unreachable {
                    servers: self.config.shown_servers(),
                    error,
                })?;
        *slot = Some(session.clone());
        Ok(session)
    }
}

impl LockBackend for ZooKeeperBackend {
    super::engine_head::engine_head!("zookeeper");

    fn check_configuration(&self) -> BoxFuture<Vec<crate::backend::Finding>> {
        let config = &self.inner.config;
        let finding = deployment::session_timeout(config.asked, config.settings.lease);
        Box::pin(async move { vec![finding] })
    }

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        let path = LockPath::new(&self.inner.config.settings.prefix, name, key.as_str());
        Box::pin(self.inner.clone().acquire(path, wait))
    }

    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let path = LockPath::new(&self.inner.config.settings.prefix, name, key.as_str());
        Box::pin(self.inner.clone().holder(path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::setup_error::assert_invalid;

    #[tokio::test]
    async fn a_drift_of_half_the_timeout_and_a_bad_prefix_are_refused_by_name() {
        let builder = ZooKeeperBackend::builder("127.0.0.1:1")
            .lease(Duration::from_secs(2))
            .drift_margin(Duration::from_secs(1));
        assert_invalid(builder.build().await, "drift margin");
        for prefix in ["/zookeeper/locks", "/", "/a/../b"] {
            let builder = ZooKeeperBackend::builder("127.0.0.1:1").prefix(prefix);
            assert_invalid(builder.build().await, prefix);
        }
    }

    #[test]
    fn errors_show_the_servers_without_credentials() {
        let builder = ZooKeeperBackend::builder("user:secret@a:1,b:2/chroot@x");
        assert_eq!(builder.config.shown_servers(), "a:1,b:2/chroot@x");
    }

    #[test]
    fn the_connect_timeout_is_one_command_timeout_per_server() {
        let builder =
            ZooKeeperBackend::builder("a:1,b:2,c:3").command_timeout(Duration::from_millis(300));
        assert_eq!(builder.config.connect_timeout(), Duration::from_millis(900));
    }
}
