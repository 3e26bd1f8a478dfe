//! A real `redis-server` process on a free port of 127.0.0.1, killed on drop. Each
//! server has a data directory of its own, so a snapshot (`SAVE`) is read back only by
//! [`RedisServer::restart_from_snapshot`] of the same server.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    /// Holds `dump.rdb` when the test saved a snapshot; removed on drop.
    dir: PathBuf,
    role: Role,
    /// More `redis-server` arguments, such as `["--maxmemory-policy", "allkeys-lru"]`.
    extra: Vec<String>,
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
        let replica = Self::start_as(Role::Replica(primary.port), &[]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !info(replica.port, "replication").contains("master_link_status:up") {
            assert!(
                Instant::now() < deadline,
                "the replica did not sync within 10 s"
            );
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
        Self::start_as(Role::Sentinel(primary.port), &[])
    }

    fn start_as(role: Role, extra: &[&str]) -> Self {
        // The port is free when we look; another process may take it before Redis
        // binds, so try a few.
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = super::ports::free_port();
            let dir = std::env::temp_dir().join(format!(
                "tower-keyed-lock-redis-{}-{port}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).expect("creating the redis data directory");
            let mut server = Self {
                port,
                child: None,
                dir,
                role,
                extra: extra.iter().map(|arg| (*arg).to_owned()).collect(),
            };
            match server.spawn() {
                Ok(()) => return server,
                Err(error) => last_error = error,
            }
        }
        panic!("could not start redis-server: {last_error}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
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
        self.child.is_some()
    }

    /// The process id of the running server.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("redis-server is stopped").id()
    }

    /// Kills the server (SIGKILL: no clean shutdown, like a crash).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts a fresh (empty) one on the same port.
    pub fn restart(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(self.dir.join("dump.rdb"));
        self.start_again();
    }

    /// Kills the server (SIGKILL, so nothing is saved on the way out) and starts it
    /// again on the same port from its last snapshot (`SAVE`): every write after the
    /// snapshot is lost, as after a crash with RDB persistence.
    pub fn restart_from_snapshot(&mut self) {
        self.stop();
        assert!(
            self.dir.join("dump.rdb").exists(),
            "no snapshot to restart from: SAVE first"
        );
        self.start_again();
    }

    fn start_again(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(error) if Instant::now() > deadline => {
                    panic!("could not restart redis-server: {error}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        signal(self.pid(), "-STOP");
    }

    /// Undoes [`pause`](Self::pause).
    pub fn resume(&self) {
        signal(self.pid(), "-CONT");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut command = Command::new("redis-server");
        match self.role {
            Role::Sentinel(primary) => {
                // Sentinel rewrites its configuration file, so it gets one of its own.
                let config = self.dir.join("sentinel.conf");
                let text = format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary} 1\n\
                     sentinel down-after-milliseconds {SENTINEL_MASTER} 500\n\
                     sentinel failover-timeout {SENTINEL_MASTER} 2000\n",
                    port = self.port,
                    dir = self.dir.display(),
                );
                std::fs::write(&config, text).map_err(|error| error.to_string())?;
                command.arg(&config).arg("--sentinel");
            }
            Role::Primary | Role::Replica(_) | Role::ClusterNode => {
                command
                    .args(["--port", &self.port.to_string()])
                    .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
                    .args(["--dir", &self.dir.to_string_lossy()])
                    // Replicas sync at once, not after the default 5 s wait for others.
                    .args(["--repl-diskless-sync-delay", "0"]);
                match self.role {
                    Role::Replica(primary) => {
                        command.args(["--replicaof", "127.0.0.1", &primary.to_string()]);
                    }
                    Role::ClusterNode => {
                        command.args([
                            "--cluster-enabled",
                            "yes",
                            "--cluster-node-timeout",
                            "1000",
                        ]);
                    }
                    _ => {}
                }
                command.args(&self.extra);
            }
        }
        let mut child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|error| match error.kind() {
                std::io::ErrorKind::NotFound => panic!(
                    "redis-server is not on PATH: run ./scripts/test, which installs it \
                     (or install redis-server yourself)"
                ),
                _ => format!("spawning redis-server: {error}"),
            })?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("redis-server exited with {status}"));
            }
            if ping(self.port) {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err("redis-server did not answer PING within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL also ends a paused (stopped) process.
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill {signal} {pid} failed");
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
