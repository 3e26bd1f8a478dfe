//! A real 3-member etcd cluster (`etcd` from the Debian package `etcd-server`) on free
//! ports of 127.0.0.1: start, stop, kill, pause or restart one member, find the leader. Every
//! member is killed and its data directory removed on drop.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::ports::free_port;

/// Raft heartbeat and election timeout of the test cluster. With these, etcd's shortest
/// lease is (3 × 6 / 2) heartbeats = 900 ms, rounded up to 1 s: a 1 s lease is granted
/// as asked. A leader is replaced within about an election timeout.
pub const HEARTBEAT: Duration = Duration::from_millis(100);
pub const ELECTION_TIMEOUT: Duration = Duration::from_millis(600);

/// How long a member or the cluster may take to start on a loaded machine.
const STARTUP: Duration = Duration::from_secs(30);

pub struct EtcdCluster {
    members: Vec<Member>,
    dir: PathBuf,
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// The path of the `etcd` binary, or a panic that says how to install it.
fn etcd_binary() -> String {
    let binary = std::env::var("ETCD_BIN").unwrap_or_else(|_| "etcd".to_owned());
    let found = Command::new(&binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    assert!(
        found,
        "`{binary}` not found: the etcd tests need an etcd server (Debian: \
         `apt-get install etcd-server`; scripts/test installs it), or ETCD_BIN set to one"
    );
    binary
}

impl EtcdCluster {
    /// Starts three members and waits until they have a leader; panics if `etcd` is not
    /// installed or the cluster does not come up.
    pub fn start() -> Self {
        Self::start_with(3)
    }

    /// Starts `size` members.
    pub fn start_with(size: usize) -> Self {
        let binary = etcd_binary();
        // Ports are free when we look; a clash (another process took one first) shows
        // as a member that does not start, and the whole cluster is tried again.
        let mut last_error = String::new();
        for attempt in 0..3 {
            let base = if std::path::Path::new("/dev/shm").is_dir() {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            let dir = base.join(format!(
                "tower-keyed-lock-etcd-{}-{}-{attempt}",
                std::process::id(),
                free_port()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("creating the etcd data directory");
            let members = (0..size)
                .map(|n| Member {
                    name: format!("m{n}"),
                    client_port: free_port(),
                    peer_port: free_port(),
                    child: None,
                })
                .collect();
            let mut cluster = EtcdCluster { members, dir };
            for index in 0..size {
                cluster.spawn(&binary, index, "new");
            }
            match cluster.wait_for_leader(STARTUP) {
                Ok(()) => return cluster,
                Err(error) => last_error = error,
            }
        }
        panic!("could not start an etcd cluster: {last_error}");
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, binary: &str, index: usize, state: &str) {
        let initial_cluster = self.initial_cluster();
        let data = self.dir.join(&self.members[index].name);
        let log = std::fs::File::create(self.dir.join(format!("{}.log", self.members[index].name)))
            .expect("creating the etcd log");
        let member = &mut self.members[index];
        let client = format!("http://127.0.0.1:{}", member.client_port);
        let peer = format!("http://127.0.0.1:{}", member.peer_port);
        let child = Command::new(binary)
            .args(["--name", &member.name])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "tower-keyed-lock"])
            .args(["--heartbeat-interval", &HEARTBEAT.as_millis().to_string()])
            .args([
                "--election-timeout",
                &ELECTION_TIMEOUT.as_millis().to_string(),
            ])
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning etcd");
        member.child = Some(child);
    }

    /// The client URLs of every member, running or not.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// The client URL of member `index`.
    pub fn endpoint(&self, index: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[index].client_port)
    }

    /// The client port of member `index`.
    pub fn client_port(&self, index: usize) -> u16 {
        self.members[index].client_port
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Kills member `index` (SIGKILL, like a crash); its data stays for a restart.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.members[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops member `index` (SIGSTOP): it keeps its sockets and state but does nothing,
    /// like a process stalled by the scheduler or a slow disk, until [`resume`](Self::resume).
    pub fn pause(&self, index: usize) {
        self.signal(index, "-STOP");
    }

    /// Lets a member stopped by [`pause`](Self::pause) run again (SIGCONT).
    pub fn resume(&self, index: usize) {
        self.signal(index, "-CONT");
    }

    fn signal(&self, index: usize, signal: &str) {
        let child = self.members[index].child.as_ref().expect("the member runs");
        let sent = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .is_ok_and(|status| status.success());
        assert!(sent, "`kill {signal}` failed for etcd member {index}");
    }

    /// Kills every member.
    pub fn kill_all(&mut self) {
        for index in 0..self.members.len() {
            self.kill(index);
        }
    }

    /// Starts member `index` again on its data directory (it rejoins the cluster).
    pub fn restart(&mut self, index: usize) {
        self.kill(index);
        let binary = etcd_binary();
        self.spawn(&binary, index, "existing");
    }

    /// Whether member `index` runs.
    pub fn is_running(&self, index: usize) -> bool {
        self.members[index].child.is_some()
    }

    /// The index of the member that is leader now, as a running member reports it.
    pub fn leader(&self) -> Option<usize> {
        for (index, member) in self.members.iter().enumerate() {
            if member.child.is_none() {
                continue;
            }
            let Some(status) = status(member.client_port) else {
                continue;
            };
            // `{"header":{..."member_id":"<id>"...},"leader":"<id>",...}` (grpc-gateway
            // JSON: 64-bit ids as decimal strings).
            let (Some(me), Some(leader)) = (field(&status, "member_id"), field(&status, "leader"))
            else {
                continue;
            };
            if leader == "0" {
                return None;
            }
            if me == leader {
                return Some(index);
            }
        }
        None
    }

    /// Waits until the running members have a leader.
    pub fn wait_for_leader(&self, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if self.leader().is_some() {
                return Ok(());
            }
            if started.elapsed() > limit {
                let logs: String = self
                    .members
                    .iter()
                    .map(|m| {
                        let log = std::fs::read_to_string(self.dir.join(format!("{}.log", m.name)))
                            .unwrap_or_default();
                        let tail: Vec<_> = log.lines().rev().take(5).collect();
                        format!("{}: {}\n", m.name, tail.join(" | "))
                    })
                    .collect();
                return Err(format!("no leader after {limit:?}; logs:\n{logs}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `POST /v3/maintenance/status` on the grpc-gateway of a member: its JSON, if it
/// answered within a second.
fn status(port: u16) -> Option<String> {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    let request = format!(
        "POST /v3/maintenance/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response
        .starts_with("HTTP/1.1 200")
        .then(|| response.split("\r\n\r\n").nth(1).unwrap_or("").to_owned())
}

/// The string value of `"name":"value"` in `json`.
fn field<'a>(json: &'a str, name: &str) -> Option<&'a str> {
    let start = json.find(&format!("\"{name}\":\""))? + name.len() + 4;
    json[start..].split('"').next()
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill_all();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
