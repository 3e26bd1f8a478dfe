//! A real `redis-server` process on a free port of 127.0.0.1, killed on drop. Each
//! server has a data directory of its own, so a snapshot (`SAVE`) is read back only by
//! [`RedisServer::restart_from_snapshot`] of the same server.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use super::process::{ServerProcess, TempDir};

pub struct RedisServer {
    /// Its directory holds `dump.rdb` when the test saved a snapshot.
    process: ServerProcess,
}

/// What a server is started as.
#[derive(Clone, Copy)]
enum Role {
    Primary,
    /// A replica of the primary on this port.
    Replica(u16),
    /// A Sentinel monitoring the primary on this port as `mymaster`, with a quorum of
    /// one and short timeouts (down after 500 ms).
    Sentinel(u16),
    /// A Redis Cluster node (not yet part of a cluster), failing over after 1 s.
    ClusterNode,
}

/// The name under which a test Sentinel monitors its primary.
pub const SENTINEL_MASTER: &str = "mymaster";

impl RedisServer {
    /// Starts a server on a free port; panics if `redis-server` is not installed.
    pub fn start() -> Self {
        Self::start_as(Role::Primary, &[])
    }

    /// Starts a server with more `redis-server` arguments, such as
    /// `&["--maxmemory-policy", "volatile-ttl"]`; they are kept for a restart.
    pub fn start_with_args(args: &[&str]) -> Self {
        Self::start_as(Role::Primary, args)
    }

    /// Starts a replica of `primary` and waits until it is in sync.
    pub fn start_replica_of(primary: &RedisServer) -> Self {
        let replica = Self::start_as(Role::Replica(primary.port()), &[]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !info(replica.port(), "replication").contains("master_link_status:up") {
            if Instant::now() > deadline {
                replica.process.fail("the replica did not sync within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        replica
    }

    /// Starts a node for a Redis Cluster; see `redis_cluster.rs`.
    pub fn start_cluster_node() -> Self {
        Self::start_as(Role::ClusterNode, &[])
    }

    /// Starts a Sentinel that monitors `primary` as [`SENTINEL_MASTER`].
    pub fn start_sentinel_of(primary: &RedisServer) -> Self {
        Self::start_as(Role::Sentinel(primary.port()), &[])
    }

    fn start_as(role: Role, extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|arg| (*arg).to_owned()).collect();
        let name = match role {
            Role::Primary => "redis-server",
            Role::Replica(_) => "redis replica",
            Role::Sentinel(_) => "redis sentinel",
            Role::ClusterNode => "redis cluster node",
        };
        let process = ServerProcess::new(name, TempDir::new("redis"))
            .command(move |process| command(role, &extra, process))
            .ready_when(|process| ping(process.port()))
            .start(5);
        Self { process }
    }

    pub fn port(&self) -> u16 {
        self.process.port()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port())
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    /// A connection of its own, for a test's direct commands.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        self.client()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Whether the server process runs (it was not stopped).
    pub fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// The process id of the running server.
    pub fn pid(&self) -> u32 {
        self.process.pid().expect("redis-server is stopped")
    }

    /// Kills the server (SIGKILL: no clean shutdown, like a crash).
    pub fn stop(&mut self) {
        self.process.kill();
    }

    /// Kills the server and starts a fresh (empty) one on the same port.
    pub fn restart(&mut self) {
        self.process.kill();
        let _ = std::fs::remove_file(self.process.dir().join("dump.rdb"));
        self.process.start_again();
    }

    /// Kills the server (SIGKILL, so nothing is saved on the way out) and starts it
    /// again on the same port from its last snapshot (`SAVE`): every write after the
    /// snapshot is lost, as after a crash with RDB persistence.
    pub fn restart_from_snapshot(&mut self) {
        self.process.kill();
        assert!(
            self.process.dir().join("dump.rdb").exists(),
            "no snapshot to restart from: SAVE first"
        );
        self.process.start_again();
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// Undoes [`pause`](Self::pause).
    pub fn resume(&self) {
        self.process.resume();
    }
}

/// The command line of a server in `role`, on the process's port and directory.
fn command(role: Role, extra: &[String], process: &ServerProcess) -> Command {
    let (port, dir) = (process.port(), process.dir());
    let mut command = Command::new("redis-server");
    match role {
        Role::Sentinel(primary) => {
            // Sentinel rewrites its configuration file, so it gets one of its own.
            let config = dir.join("sentinel.conf");
            let text = format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary} 1\n\
                 sentinel down-after-milliseconds {SENTINEL_MASTER} 500\n\
                 sentinel failover-timeout {SENTINEL_MASTER} 2000\n",
                dir = dir.display(),
            );
            std::fs::write(&config, text).expect("writing sentinel.conf");
            command.arg(&config).arg("--sentinel");
        }
        Role::Primary | Role::Replica(_) | Role::ClusterNode => {
            command
                .args(["--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
                .arg("--dir")
                .arg(dir)
                // Replicas sync at once, not after the default 5 s wait for others.
                .args(["--repl-diskless-sync-delay", "0"]);
            match role {
                Role::Replica(primary) => {
                    command.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
                }
                Role::ClusterNode => {
                    command.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"]);
                }
                _ => {}
            }
            command.args(extra);
        }
    }
    command
}

/// A section of `INFO` of the server on `port`, through `redis-cli`.
pub fn info(port: u16, section: &str) -> String {
    cli(port, &["INFO", section])
}

/// Runs one command with `redis-cli` against the server on `port`; its output.
pub fn cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("running redis-cli");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Whether a server on `port` answers `PING` with `+PONG`.
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
}

/// Calls per command since the server started, from `INFO commandstats`.
pub async fn command_calls(
    connection: &mut redis::aio::MultiplexedConnection,
) -> BTreeMap<String, u64> {
    command_stat(connection, "calls").await
}

/// One field of `INFO commandstats` (`calls`, `usec_per_call`, …) per command.
pub async fn command_stat<T: std::str::FromStr>(
    connection: &mut redis::aio::MultiplexedConnection,
    field: &str,
) -> BTreeMap<String, T> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(connection)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let (name, stats) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let value = stats
                .split(',')
                .find_map(|pair| pair.strip_prefix(field)?.strip_prefix('='))?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}
