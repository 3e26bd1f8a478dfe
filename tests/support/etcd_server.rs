//! A real 3-member etcd cluster (`etcd` from the Debian package `etcd-server`) on free
//! ports of 127.0.0.1: start, stop, kill, pause or restart one member, find the leader. Every
//! member is killed and its data directory removed on drop.
#![allow(dead_code)]

use std::process::Command;
use std::time::{Duration, Instant};

use super::ports::free_port;
use super::process::{gave_up, missing, retry, runs, ServerProcess, TempDir};

/// Raft heartbeat and election timeout of the test cluster. With these, etcd's shortest
/// lease is (3 × 6 / 2) heartbeats = 900 ms, rounded up to 1 s: a 1 s lease is granted
/// as asked. A leader is replaced within about an election timeout.
pub const HEARTBEAT: Duration = Duration::from_millis(100);
pub const ELECTION_TIMEOUT: Duration = Duration::from_millis(600);

/// How long a member or the cluster may take to start on a loaded machine.
const STARTUP: Duration = Duration::from_secs(30);

pub struct EtcdCluster {
    /// Each on a client port and a peer port.
    members: Vec<ServerProcess>,
}

/// The path of the `etcd` binary, or a panic that says how to install it.
fn etcd_binary() -> String {
    let binary = std::env::var("ETCD_BIN").unwrap_or_else(|_| "etcd".to_owned());
    if !runs(&binary, &["--version"]) {
        missing(
            &format!("`{binary}`"),
            " (Debian package etcd-server), or set ETCD_BIN to an etcd binary",
        );
    }
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
        // A clash on a port shows as a member that does not start: the whole cluster
        // is tried again, on fresh ports and directories.
        let started = retry(3, || {
            let ports: Vec<Vec<u16>> = (0..size).map(|_| vec![free_port(), free_port()]).collect();
            let initial_cluster = ports
                .iter()
                .enumerate()
                .map(|(n, ports)| format!("m{n}=http://127.0.0.1:{}", ports[1]))
                .collect::<Vec<_>>()
                .join(",");
            let members = ports
                .into_iter()
                .enumerate()
                .map(|(n, ports)| {
                    let (binary, initial_cluster) = (binary.clone(), initial_cluster.clone());
                    ServerProcess::new(format!("etcd member m{n}"), TempDir::in_memory("etcd"))
                        .on_ports(ports)
                        .command(move |process| {
                            member_command(&binary, &format!("m{n}"), &initial_cluster, process)
                        })
                })
                .collect();
            let mut cluster = EtcdCluster { members };
            for member in &mut cluster.members {
                member.launch();
            }
            cluster.wait_for_leader(STARTUP).map(|()| cluster)
        });
        started.unwrap_or_else(|failures| panic!("could not start an etcd cluster: {failures}"))
    }

    /// The client URLs of every member, running or not.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.size()).map(|index| self.endpoint(index)).collect()
    }

    /// The client URL of member `index`.
    pub fn endpoint(&self, index: usize) -> String {
        format!("http://127.0.0.1:{}", self.client_port(index))
    }

    /// The client port of member `index`.
    pub fn client_port(&self, index: usize) -> u16 {
        self.members[index].port()
    }

    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Kills member `index` (SIGKILL, like a crash); its data stays for a restart.
    pub fn kill(&mut self, index: usize) {
        self.members[index].kill();
    }

    /// Stops member `index` (SIGSTOP): it keeps its sockets and state but does nothing,
    /// like a process stalled by the scheduler or a slow disk, until [`resume`](Self::resume).
    pub fn pause(&self, index: usize) {
        self.members[index].pause();
    }

    /// Lets a member stopped by [`pause`](Self::pause) run again (SIGCONT).
    pub fn resume(&self, index: usize) {
        self.members[index].resume();
    }

    /// Kills every member.
    pub fn kill_all(&mut self) {
        for member in &mut self.members {
            member.kill();
        }
    }

    /// Starts member `index` again on its data directory (it rejoins the cluster).
    pub fn restart(&mut self, index: usize) {
        self.members[index].kill();
        self.members[index].launch();
    }

    /// Whether member `index` runs.
    pub fn is_running(&self, index: usize) -> bool {
        self.members[index].is_running()
    }

    /// The index of the member that is leader now, as a running member reports it.
    pub fn leader(&self) -> Option<usize> {
        for (index, member) in self.members.iter().enumerate() {
            if !member.is_running() {
                continue;
            }
            let Some(status) = status(member.port()) else {
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

    /// Waits until the running members have a leader; fails at once if a member exited
    /// on its own.
    pub fn wait_for_leader(&self, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if self.leader().is_some() {
                return Ok(());
            }
            if let Some(why) = gave_up(&self.members, started, limit) {
                return Err(format!("no leader {why}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The command line of the etcd member `name`; a new cluster's on its first launch, an
/// existing one's after.
fn member_command(
    binary: &str,
    name: &str,
    initial_cluster: &str,
    process: &ServerProcess,
) -> Command {
    let client = format!("http://127.0.0.1:{}", process.ports()[0]);
    let peer = format!("http://127.0.0.1:{}", process.ports()[1]);
    let state = match process.launches() {
        0 => "new",
        _ => "existing",
    };
    let mut command = Command::new(binary);
    command
        .args(["--name", name])
        .arg("--data-dir")
        .arg(process.dir().join("data"))
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", initial_cluster])
        .args(["--initial-cluster-state", state])
        .args(["--initial-cluster-token", "tower-keyed-lock"])
        .args(["--heartbeat-interval", &HEARTBEAT.as_millis().to_string()])
        .args([
            "--election-timeout",
            &ELECTION_TIMEOUT.as_millis().to_string(),
        ])
        .args(["--log-level", "warn"]);
    command
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
