//! A real 3-server ZooKeeper ensemble (the Debian package `zookeeper`, on the installed
//! Java) on free ports of 127.0.0.1: start, kill, restart, pause or resume one server,
//! find the leader, and (for an ensemble started `partitionable`) cut one server off
//! from the others. Every server is killed and its data directory removed on drop.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ports::free_port;

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
    servers: Vec<Server>,
    dir: PathBuf,
    /// `links[from][to]`: the relays server `from` reaches server `to` through (quorum
    /// and election ports), when partitionable.
    links: Vec<Vec<Option<[Relay; 2]>>>,
    /// The servers' tick.
    tick: Duration,
}

struct Server {
    client_port: u16,
    quorum_port: u16,
    election_port: u16,
    child: Option<Child>,
}

/// The ZooKeeper jar, or a panic that says how to install it.
fn zookeeper_jar() -> String {
    let jar = std::env::var("ZOOKEEPER_JAR").unwrap_or_else(|_| DEFAULT_JAR.to_owned());
    assert!(
        std::path::Path::new(&jar).is_file(),
        "`{jar}` not found: the ZooKeeper tests need a ZooKeeper server (Debian: \
         `apt-get install zookeeper`; scripts/test installs it), or ZOOKEEPER_JAR set to \
         one"
    );
    let java = Command::new("java")
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    assert!(java, "`java` not found: ZooKeeper needs a Java runtime");
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
        let mut last_error = String::new();
        // Ports are free when we look; a clash shows as a server that does not start,
        // and the whole ensemble is tried again.
        for attempt in 0..3 {
            let base = if std::path::Path::new("/dev/shm").is_dir() {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            let dir = base.join(format!(
                "tower-keyed-lock-zookeeper-{}-{}-{attempt}",
                std::process::id(),
                free_port()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("creating the ZooKeeper data directory");
            let servers: Vec<Server> = (0..3)
                .map(|_| Server {
                    client_port: free_port(),
                    quorum_port: free_port(),
                    election_port: free_port(),
                    child: None,
                })
                .collect();
            let links = (0..3)
                .map(|from| {
                    (0..3)
                        .map(|to| {
                            (partitionable && from != to).then(|| {
                                [
                                    Relay::start(servers[to].quorum_port),
                                    Relay::start(servers[to].election_port),
                                ]
                            })
                        })
                        .collect()
                })
                .collect();
            let mut ensemble = ZooKeeperEnsemble {
                servers,
                dir,
                links,
                tick,
            };
            for index in 0..3 {
                ensemble.configure(index);
                ensemble.spawn(&jar, index);
            }
            match ensemble.wait_for_leader(STARTUP) {
                Ok(()) => return ensemble,
                Err(error) => last_error = error,
            }
        }
        panic!("could not start a ZooKeeper ensemble: {last_error}");
    }

    /// Writes server `index`'s data directory (`myid`) and `zoo.cfg`: its own ports, and
    /// the others' (through the relays, if any).
    fn configure(&self, index: usize) {
        let data = self.dir.join(format!("s{index}"));
        std::fs::create_dir_all(&data).expect("creating a server's data directory");
        std::fs::write(data.join("myid"), format!("{}\n", index + 1)).expect("writing myid");
        let me = &self.servers[index];
        let mut config = format!(
            "tickTime={}\ninitLimit={INIT_LIMIT}\nsyncLimit={SYNC_LIMIT}\n\
             dataDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\n\
             admin.enableServer=false\n4lw.commands.whitelist=srvr\n\
             maxClientCnxns=0\npreAllocSize=1024\n",
            self.tick.as_millis(),
            data.display(),
            me.client_port,
        );
        for (other, server) in self.servers.iter().enumerate() {
            let (quorum, election) = match &self.links[index][other] {
                Some([quorum, election]) => (quorum.port, election.port),
                None => (server.quorum_port, server.election_port),
            };
            config.push_str(&format!(
                "server.{}=127.0.0.1:{quorum}:{election}\n",
                other + 1
            ));
        }
        std::fs::write(self.config_path(index), config).expect("writing zoo.cfg");
    }

    fn config_path(&self, index: usize) -> PathBuf {
        self.dir.join(format!("zoo-{index}.cfg"))
    }

    fn log_path(&self, index: usize) -> PathBuf {
        self.dir.join(format!("s{index}.log"))
    }

    fn spawn(&mut self, jar: &str, index: usize) {
        let log = std::fs::File::create(self.log_path(index)).expect("creating the log");
        let child = Command::new("java")
            // A small heap and the quick compiler: three JVMs on a shared 2-core box,
            // where startup time counts more than peak speed.
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
            .arg(self.config_path(index))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("cloning the log"))
            .stderr(log)
            .spawn()
            .expect("spawning java");
        self.servers[index].child = Some(child);
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
        format!("127.0.0.1:{}", self.servers[index].client_port)
    }

    /// The client address of server `index`.
    pub fn client_addr(&self, index: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.servers[index].client_port))
    }

    pub fn size(&self) -> usize {
        self.servers.len()
    }

    /// Kills server `index` (SIGKILL, like a crash); its data stays for a restart.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.servers[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills every server.
    pub fn kill_all(&mut self) {
        for index in 0..self.servers.len() {
            self.kill(index);
        }
    }

    /// Starts server `index` again on its data directory (it rejoins the ensemble).
    pub fn restart(&mut self, index: usize) {
        self.kill(index);
        let jar = zookeeper_jar();
        self.spawn(&jar, index);
    }

    /// Stops server `index` without killing it (SIGSTOP): its sockets stay open and
    /// silent.
    pub fn pause(&self, index: usize) {
        self.signal(index, "STOP");
    }

    /// Lets a paused server run again (SIGCONT).
    pub fn resume(&self, index: usize) {
        self.signal(index, "CONT");
    }

    fn signal(&self, index: usize, signal: &str) {
        if let Some(child) = &self.servers[index].child {
            let status = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(child.id().to_string())
                .status()
                .expect("running kill");
            assert!(status.success(), "kill -{signal} failed");
        }
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
        self.servers[index].child.is_some()
    }

    /// What server `index` says it is (`leader`, `follower`, `standalone`), if it
    /// answers `srvr` within a second and serves.
    pub fn mode(&self, index: usize) -> Option<String> {
        self.servers[index].child.as_ref()?;
        let answer = four_letter(self.servers[index].client_port, "srvr")?;
        let mode = answer
            .lines()
            .find_map(|line| line.strip_prefix("Mode: "))?;
        Some(mode.trim().to_owned())
    }

    /// The index of the leader now, as it reports itself.
    pub fn leader(&self) -> Option<usize> {
        (0..self.servers.len()).find(|&index| self.mode(index).as_deref() == Some("leader"))
    }

    /// Waits until a running server leads and every other running one follows.
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
            if started.elapsed() > limit {
                let logs: String = (0..self.servers.len())
                    .map(|index| {
                        let log = std::fs::read_to_string(self.log_path(index)).unwrap_or_default();
                        let tail: Vec<_> = log.lines().rev().take(5).collect();
                        format!("s{index}: {}\n", tail.join(" | "))
                    })
                    .collect();
                return Err(format!(
                    "no leader after {limit:?} ({modes:?}); logs:\n{logs}"
                ));
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

impl Drop for ZooKeeperEnsemble {
    fn drop(&mut self) {
        for index in 0..self.servers.len() {
            self.resume(index);
        }
        self.kill_all();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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
