//! The command connection, replaced when it goes silent.
//!
//! A [`ConnectionManager`] (or a cluster connection) reconnects when its connection is
//! closed, but not when it stays open and silent (a partition or a dead NAT entry sends
//! no reset): every command then times out until TCP gives up, many minutes later. So
//! the connection sits in a slot, and after [`REPLACE_AFTER`] command timeouts in a row
//! with no answer at all for [`SILENT_FOR`] command timeouts, it is swapped for a fresh
//! one, which connects anew. An overloaded server or client still answers now and then;
//! replacing its connection would only add a reconnection to the load.

use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::io::tcp::{socket2::TcpKeepalive, TcpSettings};
use redis::ErrorKind;
use redis::{Client, Cmd, Pipeline, RedisError, RedisFuture, Value};
use tokio::sync::Notify;
use tokio::time::{timeout_at, Instant};

/// Consecutive command timeouts after which the connection is replaced. One slow
/// answer is not enough; a silent connection reaches it within a few timeouts.
pub(super) const REPLACE_AFTER: u32 = 3;

/// How many command timeouts without a single answer make a connection silent.
const SILENT_FOR: u32 = 2;

/// Where commands go: one Redis server, or a Redis Cluster.
// One per backend, built once: its size does not matter (a client is 240 bytes when a
// TLS feature of `redis` is on, as the benchmarks' peers turn on in a workspace build).
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(in crate::backend) enum Target {
    Single(Client),
    // Boxed: a cluster client is several times the size of a client.
    Cluster(Box<ClusterClient>),
}

/// A connection to a [`Target`]; both kinds reconnect lazily and are cheap to clone.
#[derive(Clone)]
pub(crate) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// The initial nodes of a cluster client (`host:port`, or a socket path), read from its
/// `Debug` form: the client has no accessor for them. Only the addresses are taken
/// (its passwords are redacted there anyway); empty if that form ever changes, and the
/// cluster is then named without them.
fn cluster_nodes(client: &ClusterClient) -> Vec<String> {
    let debug = format!("{client:?}");
    let port_of = |text: &str| -> Option<String> {
        let port: String = text.chars().take_while(char::is_ascii_digit).collect();
        (!port.is_empty()).then_some(port)
    };
    let mut nodes = Vec::new();
    let mut rest = debug.as_str();
    while let Some(at) = rest.find("addr: ") {
        rest = &rest[at + "addr: ".len()..];
        let node = if let Some(tcp) = rest.strip_prefix("Tcp(\"") {
            tcp.split_once("\", ")
                .and_then(|(host, after)| Some(format!("{host}:{}", port_of(after)?)))
        } else if let Some(tls) = rest.strip_prefix("TcpTls { host: \"") {
            tls.split_once('"').and_then(|(host, after)| {
                let (_, port) = after.split_once("port: ")?;
                Some(format!("{host}:{}", port_of(port)?))
            })
        } else if let Some(unix) = rest.strip_prefix("Unix(\"") {
            unix.split_once('"').map(|(path, _)| path.to_owned())
        } else {
            None
        };
        nodes.extend(node);
    }
    nodes
}

impl Target {
    /// Where it is: `host:port`, or a cluster's initial nodes (empty if unknown).
    pub(in crate::backend) fn address(&self) -> String {
        match self {
            Self::Single(client) => client.get_connection_info().addr().to_string(),
            Self::Cluster(client) => cluster_nodes(client).join(", "),
        }
    }

    /// A connection that connects on its first command (no await here).
    fn connect_lazily(&self, timeout: Duration) -> Result<Connection, RedisError> {
        match self {
            Self::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    // Few, short retries: a failed reconnection ends quickly and the
                    // next command starts a new one, so the backend recovers soon
                    // after Redis does.
                    .set_number_of_retries(2)
                    .set_min_delay(Duration::from_millis(20))
                    .set_max_delay(Duration::from_millis(500));
                let manager = ConnectionManager::new_lazy_with_config(client.clone(), config)?;
                Ok(Connection::Single(manager))
            }
            Self::Cluster(client) => {
                let config = ClusterConfig::new()
                    .set_connection_timeout(timeout)
                    .set_response_timeout(timeout);
                let connection = client.get_pending_async_connection_with_config(config);
                Ok(Connection::Cluster(connection))
            }
        }
    }
}

/// The command connection of a backend, shared by its clones.
pub(in crate::backend) struct Commands {
    target: Target,
    timeout: Duration,
    // A std lock, held only to clone or swap the connection, never across an await.
    // The number counts replacements: a timeout counts only against the connection
    // its command was sent on, so the stragglers of a replaced connection do not
    // replace its successor too.
    current: RwLock<(Connection, u64)>,
    timeouts: AtomicU32,
    /// When the last answer came, in µs since `since`.
    last_answer: AtomicU64,
    since: Instant,
    /// Notified when the connection broke or was replaced: what was read of the
    /// server before (its eviction policy) may have changed with the reconnection.
    trouble: Arc<Notify>,
}

/// Why a command failed.
#[derive(Debug)]
pub(in crate::backend) enum Failure {
    /// Redis answered with an error, or the connection failed.
    Redis(RedisError),
    /// No answer before the limit.
    TimedOut,
}

impl Commands {
    /// A lazy connection: it connects on the first command.
    pub(in crate::backend) fn new(
        target: Target,
        command_timeout: Duration,
    ) -> Result<Self, RedisError> {
        let current = target.connect_lazily(command_timeout)?;
        Ok(Self {
            target,
            timeout: command_timeout,
            current: RwLock::new((current, 0)),
            timeouts: AtomicU32::new(0),
            last_answer: AtomicU64::new(0),
            since: Instant::now(),
            trouble: Arc::new(Notify::new()),
        })
    }

    /// The command timeout.
    pub(in crate::backend) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the connection is to one server (not a cluster).
    pub(in crate::backend) fn is_single(&self) -> bool {
        matches!(self.target, Target::Single(_))
    }

    /// Notified (one stored permit) when the connection broke or was replaced.
    pub(in crate::backend) fn trouble(&self) -> Arc<Notify> {
        self.trouble.clone()
    }

    /// Runs `command` on the current connection until `limit`. A timeout counts
    /// towards replacing the connection only when `counts` (the limit was a whole
    /// command timeout, not the end of a shorter wait).
    pub(in crate::backend) async fn run<T, F>(
        &self,
        limit: Instant,
        counts: bool,
        command: impl FnOnce(Connection) -> F,
    ) -> Result<T, Failure>
    where
        F: Future<Output = Result<T, RedisError>>,
    {
        let (connection, number) = self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match timeout_at(limit, command(connection)).await {
            Ok(Ok(value)) => {
                self.timeouts.store(0, Ordering::Relaxed);
                self.last_answer.store(self.micros_now(), Ordering::Relaxed);
                return Ok(value);
            }
            // Our commands' answers have fixed types: an answer of another type is
            // one meant for another command (bytes lost on a broken path), and every
            // later answer on this connection would be off by one too.
            Ok(Err(error))
                if matches!(
                    error.kind(),
                    ErrorKind::Parse | ErrorKind::UnexpectedReturnType
                ) =>
            {
                self.replace(number, "answered out of turn");
                return Err(Failure::Redis(error));
            }
            Ok(Err(error)) if !error.is_timeout() => {
                if error.is_io_error()
                    || error.is_connection_dropped()
                    || error.is_connection_refusal()
                {
                    self.trouble.notify_one();
                }
                return Err(Failure::Redis(error));
            }
            // Our limit, or the connection's own response timeout.
            Ok(Err(_)) | Err(_) => {}
        }
        if counts {
            self.timed_out(number);
        }
        Err(Failure::TimedOut)
    }

    /// Counts a timeout of a command sent on connection `number`.
    fn timed_out(&self, number: u64) {
        // A command of a connection already replaced says nothing of the current one.
        if self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            != number
        {
            return;
        }
        let count = self.timeouts.fetch_add(1, Ordering::Relaxed) + 1;
        let quiet = self.micros_now() - self.last_answer.load(Ordering::Relaxed);
        let silent = u128::from(quiet) >= (self.timeout * SILENT_FOR).as_micros();
        if count >= REPLACE_AFTER && silent {
            self.replace(number, "silent");
        }
    }

    /// Replaces connection `number` (unless it was already replaced), because it is
    /// `why`.
    fn replace(&self, number: u64, why: &str) {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if current.1 != number {
            return;
        }
        // Lazy: no await here; the next command connects. Commands still in flight
        // on the old connection end by their own timeout, and it closes with them.
        match self.target.connect_lazily(self.timeout) {
            Ok(fresh) => {
                *current = (fresh, number + 1);
                self.timeouts.store(0, Ordering::Relaxed);
                // The fresh connection gets its own grace before it can be silent.
                self.last_answer.store(self.micros_now(), Ordering::Relaxed);
                self.trouble.notify_one();
                tracing::debug!("redis connection {why}; replaced");
            }
            Err(error) => tracing::debug!(%error, "replacing the redis connection failed"),
        }
    }
}

impl Commands {
    fn micros_now(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// TCP keepalive and (on Linux) `TCP_USER_TIMEOUT` for `client`, so the kernel also
/// notices a dead path: data unacknowledged for `give_up` closes the socket, which a
/// [`ConnectionManager`] then replaces by itself, and an idle one is probed.
pub(in crate::backend) fn with_tcp_settings(
    client: &Client,
    give_up: Duration,
) -> Result<Client, RedisError> {
    let probe = (give_up / 4).max(Duration::from_secs(1));
    let keepalive = TcpKeepalive::new().with_time(probe);
    let settings = TcpSettings::default()
        .set_nodelay(true)
        .set_keepalive(keepalive);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    let settings = settings.set_user_timeout(give_up);
    let info = client.get_connection_info().clone();
    Client::open(info.set_tcp_settings(settings))
}
