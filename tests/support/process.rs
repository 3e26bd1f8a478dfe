//! One server process of a test, whatever the server: the launchers (`redis_server`,
//! `pg_server`, `etcd_server`, …) say only how to run it and how to tell it is ready.
//!
//! - [`TempDir`]: the server's own directory (data, config, log), removed on drop;
//! - [`ServerProcess`]: spawns the command on free ports (a bounded number of tries: a
//!   port free when we look can be taken before the server binds it), sends its output
//!   to a log file in that directory, waits until a readiness probe passes within a
//!   deadline, pauses (SIGSTOP), resumes, stops, kills and starts it again; on drop it
//!   is shut down and waited for. Every panic about it names it and ends with the tail
//!   of its log;
//! - [`retry`]: a bounded number of tries, for a cluster started as a whole, and
//!   [`gave_up`]: when to stop waiting for one;
//! - [`missing`]: the panic for a server that is not installed.
#![allow(dead_code)]

use std::fs;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ports::free_port;

/// Lines of its log that a panic about a server shows.
const TAIL_LINES: usize = 30;

/// Panics: `what` is not installed; `otherwise` names its package or the variable that
/// may point at one.
pub fn missing(what: &str, otherwise: &str) -> ! {
    panic!(
        "{what} not found: run `scripts/test --install`, which installs every server the \
         tests start{otherwise}"
    )
}

/// Whether `program` runs and exits successfully with `args` (a `--version` probe).
pub fn runs(program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The first of `names` found in `dirs`, then on the `PATH`.
pub fn find_program(names: &[&str], dirs: &[&str]) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    let dirs: Vec<PathBuf> = dirs.iter().map(PathBuf::from).chain(on_path).collect();
    names
        .iter()
        .find_map(|name| dirs.iter().map(|dir| dir.join(name)).find(|p| p.is_file()))
}

/// Runs `attempt` until it succeeds, at most `tries` times: a server (or a cluster of
/// them) on ports that were free when picked, which another process may have taken
/// before the bind. Its failures otherwise.
pub fn retry<T>(tries: usize, mut attempt: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let mut failures = Vec::new();
    for _ in 0..tries {
        match attempt() {
            Ok(value) => return Ok(value),
            Err(failure) => failures.push(failure),
        }
    }
    Err(format!(
        "did not start in {tries} tries: {}",
        failures.join("; ")
    ))
}

/// Why waiting for a cluster to get ready should stop: one of its `members` exited on
/// its own, or `limit` has passed since `started`; with each member's last log lines.
pub fn gave_up(members: &[ServerProcess], started: Instant, limit: Duration) -> Option<String> {
    let exited: Vec<String> = members.iter().filter_map(ServerProcess::exited).collect();
    if exited.is_empty() && started.elapsed() <= limit {
        return None;
    }
    let logs: String = members
        .iter()
        .map(|member| {
            format!(
                "{}: {}\n",
                member.name(),
                member.tail(5).replace('\n', " | ")
            )
        })
        .collect();
    Some(format!(
        "after {:?} {exited:?}; logs:\n{logs}",
        started.elapsed()
    ))
}

/// A directory of one server, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory under the system's temp dir, named after `server`.
    pub fn new(server: &str) -> TempDir {
        Self::under(&std::env::temp_dir(), server)
    }

    /// A fresh directory in memory (`/dev/shm`) where there is one: for servers that
    /// sync their writes to disk (a consensus log), which a loaded disk would stall.
    pub fn in_memory(server: &str) -> TempDir {
        match Path::new("/dev/shm").is_dir() {
            true => Self::under(Path::new("/dev/shm"), server),
            false => Self::new(server),
        }
    }

    fn under(base: &Path, server: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = base.join(format!(
            "tower-keyed-lock-{server}-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Relaxed)
        ));
        fs::create_dir_all(&dir)
            .unwrap_or_else(|error| panic!("creating {}: {error}", dir.display()));
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

type MakeCommand = Arc<dyn Fn(&ServerProcess) -> Command + Send + Sync>;
type Probe = Arc<dyn Fn(&ServerProcess) -> bool + Send + Sync>;

/// One server process; see the module docs. Built with [`new`](Self::new) and the
/// settings below, then [`start`](Self::start)ed (a single server) or
/// [`launch`](Self::launch)ed on ports of its cluster's choosing.
pub struct ServerProcess {
    /// Names the server in every message: `redis-server`, `etcd member m1`.
    name: String,
    dir: TempDir,
    log: PathBuf,
    ports: Vec<u16>,
    /// How to run it, fixed before it starts (boxed: a launcher stays small to move).
    settings: Box<Settings>,
    /// `None` while stopped.
    child: Mutex<Option<Child>>,
    launches: usize,
    /// Where the current launch's output starts in the log.
    log_start: u64,
}

struct Settings {
    /// Free ports each try of `start` picks; 0 when the server announces its port.
    free_ports: usize,
    announced_port: Option<fn(&str) -> Option<u16>>,
    command: MakeCommand,
    ready: Probe,
    ready_within: Duration,
    poll_every: Duration,
    /// The file the server writes its pid to, when the child we spawn is not the server
    /// itself (`runuser`): signals go to that pid.
    pid_file: Option<PathBuf>,
    /// Sent on drop before SIGKILL, for a server that leaves things behind when killed.
    shutdown_signal: Option<&'static str>,
}

impl ServerProcess {
    /// A server called `name` living in `dir`, not started yet. By default it needs one
    /// free port, is ready as soon as it runs, within 10 s, and is killed on drop.
    pub fn new(name: impl Into<String>, dir: TempDir) -> ServerProcess {
        let name = name.into();
        let log = dir.path().join(format!("{}.log", slug(&name)));
        ServerProcess {
            name,
            dir,
            log,
            ports: Vec::new(),
            settings: Box::new(Settings {
                free_ports: 1,
                announced_port: None,
                command: Arc::new(|_| panic!("a server process needs a command")),
                ready: Arc::new(|_| true),
                ready_within: Duration::from_secs(10),
                poll_every: Duration::from_millis(10),
                pid_file: None,
                shutdown_signal: None,
            }),
            child: Mutex::new(None),
            launches: 0,
            log_start: 0,
        }
    }

    /// How to run the server, asked before every launch (so it may write its config
    /// file first); it reads the ports and directory from the process it is given.
    pub fn command(
        mut self,
        command: impl Fn(&ServerProcess) -> Command + Send + Sync + 'static,
    ) -> Self {
        self.settings.command = Arc::new(command);
        self
    }

    /// What tells that the server is ready (it answers a ping, writes `ready` to its
    /// pid file, …), polled until it holds.
    pub fn ready_when(
        mut self,
        ready: impl Fn(&ServerProcess) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.settings.ready = Arc::new(ready);
        self
    }

    /// How long a launch may take to get ready on a loaded machine.
    pub fn ready_within(mut self, limit: Duration) -> Self {
        self.settings.ready_within = limit;
        self
    }

    /// How often readiness is polled (a probe that starts a process costs more).
    pub fn poll_every(mut self, interval: Duration) -> Self {
        self.settings.poll_every = interval;
        self
    }

    /// How many free ports each try of [`start`](Self::start) picks.
    pub fn free_ports(mut self, count: usize) -> Self {
        self.settings.free_ports = count;
        self
    }

    /// Ports its cluster chose, instead of free ones.
    pub fn on_ports(mut self, ports: Vec<u16>) -> Self {
        self.settings.free_ports = 0;
        self.ports = ports;
        self
    }

    /// The server binds port 0 and names the port it got in a line of its output, which
    /// `parse` reads; no other test's server can take it between a look and the bind.
    /// [`port`](Self::port) is 0 until then; a restart asks for the same port again.
    pub fn port_announced(mut self, parse: fn(&str) -> Option<u16>) -> Self {
        self.settings.free_ports = 0;
        self.ports = vec![0];
        self.settings.announced_port = Some(parse);
        self
    }

    /// The server writes its pid to `file`: signals go there (the child is `runuser`).
    pub fn pid_file(mut self, file: PathBuf) -> Self {
        self.settings.pid_file = Some(file);
        self
    }

    /// Signal sent on drop, up to 10 s before SIGKILL, for a clean end.
    pub fn shutdown_signal(mut self, signal: &'static str) -> Self {
        self.settings.shutdown_signal = Some(signal);
        self
    }

    /// Launches the server until it is ready, on fresh free ports for each of at most
    /// `tries` tries; panics with the last failure and the log's tail.
    pub fn start(mut self, tries: usize) -> Self {
        let started = retry(tries, || {
            if self.settings.free_ports > 0 {
                self.ports = (0..self.settings.free_ports).map(|_| free_port()).collect();
            }
            self.launch();
            self.wait_ready()
        });
        match started {
            Ok(()) => self,
            Err(failures) => self.fail(&failures),
        }
    }

    /// Spawns the command, its output appended to the log; does not wait. Panics,
    /// saying how to install it, if the program is not there.
    pub fn launch(&mut self) {
        assert!(!self.is_running(), "{} is already running", self.name);
        let mut command = (self.settings.command.clone())(self);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|error| panic!("opening {}: {error}", self.log.display()));
        self.log_start = log.metadata().map_or(0, |meta| meta.len());
        let output = log.try_clone().expect("cloning the log's handle");
        let child = command
            .stdin(Stdio::null())
            .stdout(output)
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| match error.kind() {
                ErrorKind::NotFound => missing(
                    &format!("`{}`", command.get_program().to_string_lossy()),
                    "",
                ),
                _ => self.fail(&format!("cannot spawn: {error}")),
            });
        *self.child.lock().unwrap() = Some(child);
        self.launches += 1;
    }

    /// Polls readiness until it holds; kills the launch and says why if the process
    /// exits first or the deadline passes.
    pub fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + self.settings.ready_within;
        loop {
            if let Some(parse) = self.settings.announced_port.filter(|_| self.port() == 0) {
                if let Some(port) = self.output().lines().find_map(parse) {
                    self.ports = vec![port];
                }
            }
            if self.port_known() && (self.settings.ready.clone())(self) {
                return Ok(());
            }
            if let Some(exit) = self.exited() {
                return Err(exit);
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(format!(
                    "{} not ready within {:?}",
                    self.describe(),
                    self.settings.ready_within
                ));
            }
            std::thread::sleep(self.settings.poll_every);
        }
    }

    /// Launches the stopped server again on the same ports and directory, trying again
    /// while it exits at once (its port not yet released) within the readiness deadline.
    pub fn start_again(&mut self) {
        let deadline = Instant::now() + self.settings.ready_within;
        loop {
            self.launch();
            match self.wait_ready() {
                Ok(()) => return,
                Err(failure) if Instant::now() > deadline => {
                    self.fail(&format!("did not start again: {failure}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Kills the server (SIGKILL, like a crash) and starts it again.
    pub fn restart(&mut self) {
        self.kill();
        self.start_again();
    }

    /// `signal` (`TERM`, `INT`, …) for a clean shutdown, then waits for the process to
    /// exit; SIGKILL after `limit`.
    pub fn stop(&mut self, signal: &str, limit: Duration) {
        if !self.is_running() {
            return;
        }
        self.resume();
        self.signal(signal);
        let deadline = Instant::now() + limit;
        while self.is_running() && self.exited().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }

    /// SIGKILL (a crash; it also ends a paused process); returns once it is gone.
    pub fn kill(&mut self) {
        let Some(mut child) = self.child.lock().unwrap().take() else {
            return;
        };
        if let Some(pid) = self.pid_in_file().filter(|&pid| pid != child.id()) {
            send(pid, "KILL");
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGSTOP: the server answers nothing, and its sockets stay open.
    pub fn pause(&self) {
        if !self.is_running() || !self.signal("STOP") {
            self.fail("cannot pause it: it does not run");
        }
    }

    /// SIGCONT after [`pause`](Self::pause); nothing if it does not run.
    pub fn resume(&self) {
        if self.is_running() {
            self.signal("CONT");
        }
    }

    /// Sends `signal` (`HUP`, `STOP`, …) to the server; whether it was delivered.
    pub fn signal(&self, signal: &str) -> bool {
        self.pid().is_some_and(|pid| send(pid, signal))
    }

    /// The server's pid (from its pid file if it has one), while it runs.
    pub fn pid(&self) -> Option<u32> {
        let child = self.child.lock().unwrap().as_ref().map(Child::id)?;
        Some(self.pid_in_file().unwrap_or(child))
    }

    /// Whether it runs: launched and neither stopped nor seen to exit.
    pub fn is_running(&self) -> bool {
        self.child.lock().unwrap().is_some()
    }

    /// If the process exited on its own, says so (it no longer counts as running).
    pub fn exited(&self) -> Option<String> {
        let mut child = self.child.lock().unwrap();
        let status = child.as_mut()?.try_wait().ok()??;
        *child = None;
        Some(format!("{} exited with {status}", self.describe()))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its first port (0 while an announced port is awaited).
    pub fn port(&self) -> u16 {
        self.ports.first().copied().unwrap_or(0)
    }

    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// How many times it was launched before (0 on its first launch).
    pub fn launches(&self) -> usize {
        self.launches
    }

    /// Everything it wrote to its output, every launch.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of its output, oldest first.
    pub fn tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Panics with `what`, naming the server, and the tail of its log.
    pub fn fail(&self, what: &str) -> ! {
        panic!(
            "{}: {what}\n--- the last lines of {} ---\n{}",
            self.describe(),
            self.log.display(),
            self.tail(TAIL_LINES)
        )
    }

    /// `name on 127.0.0.1:port[,port…]`.
    fn describe(&self) -> String {
        match self.ports.iter().filter(|&&port| port != 0).count() {
            0 => self.name.clone(),
            _ => {
                let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
                format!("{} on 127.0.0.1:{}", self.name, ports.join(","))
            }
        }
    }

    fn port_known(&self) -> bool {
        self.settings.announced_port.is_none() || self.port() != 0
    }

    /// What the current launch wrote so far.
    fn output(&self) -> String {
        let mut text = String::new();
        if let Ok(mut file) = fs::File::open(&self.log) {
            if file.seek(SeekFrom::Start(self.log_start)).is_ok() {
                let _ = file.read_to_string(&mut text);
            }
        }
        text
    }

    fn pid_in_file(&self) -> Option<u32> {
        let text = fs::read_to_string(self.settings.pid_file.as_ref()?).ok()?;
        text.lines().next()?.trim().parse().ok()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(signal) = self.settings.shutdown_signal {
            self.stop(signal, Duration::from_secs(10));
        }
        self.kill();
    }
}

/// `kill -<signal> <pid>`; whether it was delivered.
fn send(pid: u32, signal: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// `etcd member m1` → `etcd-member-m1`.
fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}
