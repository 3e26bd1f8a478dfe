//! A real 3-server ZooKeeper ensemble (the Debian package `zookeeper`, on the installed
//! Java) on free ports of 127.0.0.1: start, kill, restart, pause or resume one server,
//! find the leader, and (for an ensemble started `partitionable`) cut one server off
//! from the others. Every server is killed and its data directory removed on drop.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ports::free_port;
use super::process::{gave_up, missing, retry, runs, ServerProcess, TempDir};

/// ZooKeeper's tick in the test ensemble (unless started with one of its own): sessions
/// may last 2 to 20 ticks (400 ms to 4 s); a follower that hears nothing from its leader
/// for `SYNC_LIMIT` ticks leaves it.
pub const TICK: Duration = Duration::from_millis(200);
/// How often the test ensemble's container manager deletes empty container nodes
/// (ZooKeeper's default is a minute).
pub const CONTAINER_SWEEP: Duration = Duration::from_secs(1);
const SYNC_LIMIT: u32 = 5;
const INIT_LIMIT: u32 = 20;

/// How long a server or the ensemble may take to start on a loaded machine.
const STARTUP: Duration = Duration::from_secs(60);

/// Where the ZooKeeper server classes are (Debian: `/usr/share/java/zookeeper.jar`,
/// whose manifest names its dependencies).
const DEFAULT_JAR: &str = "/usr/share/java/zookeeper.jar";

pub struct ZooKeeperEnsemble {
    /// Each on a client, a quorum and an election port.
    servers: Vec<ServerProcess>,
    /// `links[from][to]`: the relays server `from` reaches server `to` through (quorum
    /// and election ports), when partitionable.
    links: Vec<Vec<Option<[Relay; 2]>>>,
}

/// The ZooKeeper jar, or a panic that says how to install it.
fn zookeeper_jar() -> String {
    let jar = std::env::var("ZOOKEEPER_JAR").unwrap_or_else(|_| DEFAULT_JAR.to_owned());
    if !Path::new(&jar).is_file() {
        missing(
            &format!("`{jar}`"),
            " (Debian package zookeeper), or set ZOOKEEPER_JAR to a ZooKeeper jar",
        );
    }
    if !runs("java", &["-version"]) {
        missing(
            "`java` (ZooKeeper runs on Java)",
            " (Debian package zookeeper)",
        );
    }
    jar
}

impl ZooKeeperEnsemble {
    /// Starts three servers and waits until they have a leader; panics if ZooKeeper is
    /// not installed or the ensemble does not come up.
    pub fn start() -> Self {
        Self::start_with(false, TICK)
    }

    /// The same with a tick of its own: sessions may then last up to 20 of them.
    pub fn start_with_tick(tick: Duration) -> Self {
        Self::start_with(false, tick)
    }

    /// The same, with every link between servers through a relay that
    /// [`partition`](Self::partition) can cut.
    pub fn start_partitionable() -> Self {
        Self::start_with(true, TICK)
    }

    fn start_with(partitionable: bool, tick: Duration) -> Self {
        let jar = zookeeper_jar();
        // A clash on a port shows as a server that does not start: the whole ensemble
        // is tried again, on fresh ports and directories.
        let started = retry(3, || {
            let ports: Vec<Vec<u16>> = (0..3)
                .map(|_| vec![free_port(), free_port(), free_port()])
                .collect();
            let links: Vec<Vec<Option<[Relay; 2]>>> = (0..3)
                .map(|from| {
                    (0..3)
                        .map(|to| {
                            (partitionable && from != to)
                                .then(|| [Relay::start(ports[to][1]), Relay::start(ports[to][2])])
                        })
                        .collect()
                })
                .collect();
            let servers = (0..3)
                .map(|index| {
                    let dir = TempDir::in_memory("zookeeper");
                    let data = dir.path().join("data");
                    let config = config(index, &ports, &links[index], tick, &data);
                    let jar = jar.clone();
                    ServerProcess::new(format!("zookeeper server s{index}"), dir)
                        .on_ports(ports[index].clone())
                        .command(move |process| {
                            std::fs::create_dir_all(&data).expect("creating the data directory");
                            std::fs::write(data.join("myid"), format!("{}\n", index + 1))
                                .expect("writing myid");
                            let path = process.dir().join("zoo.cfg");
                            std::fs::write(&path, &config).expect("writing zoo.cfg");
                            java(&jar, &path)
                        })
                })
                .collect();
            let mut ensemble = ZooKeeperEnsemble { servers, links };
            for server in &mut ensemble.servers {
                server.launch();
            }
            ensemble.wait_for_leader(STARTUP).map(|()| ensemble)
        });
        started
            .unwrap_or_else(|failures| panic!("could not start a ZooKeeper ensemble: {failures}"))
    }

    /// The connect string of every server, running or not.
    pub fn connect_string(&self) -> String {
        (0..self.servers.len())
            .map(|index| self.address(index))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `127.0.0.1:<client port>` of server `index`.
    pub fn address(&self, index: usize) -> String {
        format!("127.0.0.1:{}", self.servers[index].port())
    }

    /// The client address of server `index`.
    pub fn client_addr(&self, index: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.servers[index].port()))
    }

    pub fn size(&self) -> usize {
        self.servers.len()
    }

    /// Kills server `index` (SIGKILL, like a crash); its data stays for a restart.
    pub fn kill(&mut self, index: usize) {
        self.servers[index].kill();
    }

    /// Kills every server.
    pub fn kill_all(&mut self) {
        for server in &mut self.servers {
            server.kill();
        }
    }

    /// Starts server `index` again on its data directory (it rejoins the ensemble).
    pub fn restart(&mut self, index: usize) {
        self.servers[index].kill();
        self.servers[index].launch();
    }

    /// Stops server `index` without killing it (SIGSTOP): its sockets stay open and
    /// silent.
    pub fn pause(&self, index: usize) {
        self.servers[index].pause();
    }

    /// Lets a paused server run again (SIGCONT).
    pub fn resume(&self, index: usize) {
        self.servers[index].resume();
    }

    /// Cuts server `index` off from the others (both ways, every open link reset and
    /// new ones refused); panics unless the ensemble was started partitionable.
    pub fn partition(&self, index: usize) {
        self.set_cut(index, true);
    }

    /// Joins a partitioned server back.
    pub fn heal(&self, index: usize) {
        self.set_cut(index, false);
    }

    fn set_cut(&self, index: usize, cut: bool) {
        for other in 0..self.servers.len() {
            if other == index {
                continue;
            }
            for link in [&self.links[index][other], &self.links[other][index]] {
                let relays = link
                    .as_ref()
                    .expect("the ensemble was not started partitionable");
                for relay in relays {
                    relay.set_cut(cut);
                }
            }
        }
    }

    /// Whether server `index` runs.
    pub fn is_running(&self, index: usize) -> bool {
        self.servers[index].is_running()
    }

    /// What server `index` says it is (`leader`, `follower`, `standalone`), if it
    /// answers `srvr` within a second and serves.
    pub fn mode(&self, index: usize) -> Option<String> {
        if !self.is_running(index) {
            return None;
        }
        let answer = four_letter(self.servers[index].port(), "srvr")?;
        let mode = answer
            .lines()
            .find_map(|line| line.strip_prefix("Mode: "))?;
        Some(mode.trim().to_owned())
    }

    /// The index of the leader now, as it reports itself.
    pub fn leader(&self) -> Option<usize> {
        (0..self.servers.len()).find(|&index| self.mode(index).as_deref() == Some("leader"))
    }

    /// Waits until a running server leads and every other running one follows; fails
    /// at once if a server exited on its own.
    pub fn wait_for_leader(&self, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            let modes: Vec<Option<String>> = (0..self.servers.len())
                .filter(|&index| self.is_running(index))
                .map(|index| self.mode(index))
                .collect();
            let leaders = modes
                .iter()
                .filter(|m| m.as_deref() == Some("leader"))
                .count();
            if leaders == 1 && modes.iter().all(Option::is_some) {
                return Ok(());
            }
            if let Some(why) = gave_up(&self.servers, started, limit) {
                return Err(format!("no leader ({modes:?}) {why}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until a quorum serves again with `index` among its servers (after a
    /// restart, a resume or a heal).
    pub fn wait_for_server(&self, index: usize, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        while !matches!(self.mode(index).as_deref(), Some("leader" | "follower")) {
            if started.elapsed() > limit {
                return Err(format!("server {index} did not rejoin within {limit:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

/// Server `index`'s `zoo.cfg`: its own ports, and the others' (through its relays to
/// them, if any).
fn config(
    index: usize,
    ports: &[Vec<u16>],
    relays: &[Option<[Relay; 2]>],
    tick: Duration,
    data: &Path,
) -> String {
    let mut config = format!(
        "tickTime={}\ninitLimit={INIT_LIMIT}\nsyncLimit={SYNC_LIMIT}\n\
         dataDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\n\
         admin.enableServer=false\n4lw.commands.whitelist=srvr\n\
         maxClientCnxns=0\npreAllocSize=1024\n",
        tick.as_millis(),
        data.display(),
        ports[index][0],
    );
    for (other, ports) in ports.iter().enumerate() {
        let (quorum, election) = match &relays[other] {
            Some([quorum, election]) => (quorum.port, election.port),
            None => (ports[1], ports[2]),
        };
        config.push_str(&format!(
            "server.{}=127.0.0.1:{quorum}:{election}\n",
            other + 1
        ));
    }
    config
}

/// The server on `config`, in a JVM sized for three of them on a shared 2-core box.
fn java(jar: &str, config: &Path) -> Command {
    let mut command = Command::new("java");
    command
        // A small heap and the quick compiler: startup time counts more than peak speed.
        .args([
            "-Xmx256m",
            "-Xms32m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
        ])
        .args(["-Dzookeeper.jmx.log4j.disable=true", "-cp", jar])
        // Empty queues (container nodes) deleted within a second, as many as there
        // are: the footprint check waits for one sweep.
        .arg(format!(
            "-Dznode.container.checkIntervalMs={}",
            CONTAINER_SWEEP.as_millis()
        ))
        .arg("-Dznode.container.maxPerMinute=1000000")
        .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
        .arg(config);
    command
}

/// A four-letter-word command's answer from the server on `port`, within a second.
fn four_letter(port: u16, command: &str) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream.write_all(command.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    // A server without a quorum answers "This ZooKeeper instance is not currently
    // serving requests".
    answer.contains("Mode: ").then_some(answer)
}

/// A link between two servers: a thread-per-direction TCP relay on a free port to one
/// server's port, which can be cut (open connections shut down, new ones closed at
/// once) and healed.
struct Relay {
    port: u16,
    state: Arc<RelayState>,
}

#[derive(Default)]
struct RelayState {
    cut: AtomicBool,
    stopped: AtomicBool,
    open: Mutex<Vec<TcpStream>>,
}

impl Relay {
    fn start(upstream: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding a relay");
        let port = listener.local_addr().expect("a relay's address").port();
        let state = Arc::new(RelayState::default());
        let accepting = state.clone();
        std::thread::spawn(move || {
            for incoming in listener.incoming() {
                if accepting.stopped.load(SeqCst) {
                    break;
                }
                let Ok(downstream) = incoming else { continue };
                if accepting.cut.load(SeqCst) {
                    continue; // dropped: closed at once
                }
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let (Ok(down2), Ok(up2)) = (downstream.try_clone(), upstream.try_clone()) else {
                    continue;
                };
                {
                    let mut open = accepting.open.lock().unwrap();
                    open.retain(|stream| stream.peer_addr().is_ok());
                    open.extend(downstream.try_clone());
                    open.extend(upstream.try_clone());
                }
                pipe(downstream, up2);
                pipe(upstream, down2);
            }
        });
        Relay { port, state }
    }

    fn set_cut(&self, cut: bool) {
        self.state.cut.store(cut, SeqCst);
        if cut {
            for stream in self.state.open.lock().unwrap().drain(..) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }
}

/// Copies `from` to `to` in a thread until either side ends.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.state.stopped.store(true, SeqCst);
        self.set_cut(true);
        // Wakes the accepting thread, which then sees `stopped`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}
