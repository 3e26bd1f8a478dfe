//! A throwaway PostgreSQL server for the tests and benches: `initdb` into a temp dir,
//! `postgres` on a free port of 127.0.0.1, stopped and removed on drop.
//!
//! The binaries come from `PG_BIN`, else the newest `/usr/lib/postgresql/*/bin`
//! (`./scripts/test` installs them). PostgreSQL refuses to run as root, so under root
//! the server runs as the `postgres` system user (`runuser`, else `su`), in a temp dir
//! that user owns.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub use super::ports::free_port;

/// How long a start or stop may take before the test fails.
const STARTUP_LIMIT: Duration = Duration::from_secs(30);

pub struct PgServer {
    /// The temp dir: the data dir, the socket and the log live here.
    root: PathBuf,
    data: PathBuf,
    log: PathBuf,
    bin: PathBuf,
    port: u16,
    /// `Some(user)` when the server runs as another user (we are root).
    run_as: Option<&'static str>,
    /// The `runuser`/`postgres` process; `None` while stopped.
    child: Option<Child>,
    max_connections: u32,
}

impl PgServer {
    /// Initializes a cluster in a fresh temp dir and starts it on a free port.
    pub fn start() -> PgServer {
        Self::start_with_max_connections(60)
    }

    /// [`start`](Self::start) with room for `max_connections` sessions (a benchmark's
    /// 64 bare sessions beside the backends' pools).
    pub fn start_with_max_connections(max_connections: u32) -> PgServer {
        let bin = pg_bin();
        let run_as = is_root().then_some("postgres");
        let root = temp_dir();
        if let Some(user) = run_as {
            chown_to(&root, user);
        }
        let data = root.join("data");
        let log = root.join("postgres.log");
        let mut server = PgServer {
            root,
            data,
            log,
            bin,
            port: free_port(),
            run_as,
            child: None,
            max_connections,
        };
        let output = server
            .command("initdb")
            .arg("-D")
            .arg(&server.data)
            .args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-locale",
                "-N",
            ])
            .output()
            .expect("cannot run initdb");
        assert!(
            output.status.success(),
            "initdb failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        // Another process may take the port between our probe and postgres' bind:
        // then try another one.
        for _ in 0..3 {
            match server.spawn() {
                Ok(()) => return server,
                Err(log) if log.contains("could not bind") || log.contains("in use") => {
                    server.port = free_port();
                }
                Err(log) => panic!("postgres did not start:\n{log}"),
            }
        }
        panic!("postgres found no free port:\n{}", server.log());
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A libpq-style connection string for the `postgres` superuser.
    pub fn conn_str(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Starts the (stopped) server again on the same port and data dir; returns once
    /// it accepts connections.
    pub fn start_again(&mut self) {
        if let Err(log) = self.spawn() {
            panic!("postgres did not start again:\n{log}");
        }
    }

    /// Starts the server; returns once it accepts connections, or the log if it exited.
    fn spawn(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "the server is already running");
        // Appends, so a restart keeps the earlier log.
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("cannot open the server log");
        if let Some(user) = self.run_as {
            chown_to(&self.log, user);
        }
        // A stale pid file would make the readiness check below pass too early.
        let _ = fs::remove_file(self.data.join("postmaster.pid"));
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(&self.data)
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(&self.root)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "fsync=off"])
            .args(["-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB"])
            .arg("-c")
            .arg(format!("max_connections={}", self.max_connections))
            // `%a` (application name) lets a test attribute logged statements.
            .args(["-c", "log_line_prefix=%m [%p] %a: "])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("cannot start postgres");
        self.child = Some(child);
        self.wait_ready()
    }

    /// Fast shutdown (sessions are terminated, as in a restart); returns once the
    /// server has exited and the port is closed.
    pub fn stop(&mut self) {
        self.signal("INT");
        self.reap(STARTUP_LIMIT);
    }

    /// Polls the pid file until the postmaster reports `ready` (PostgreSQL writes its
    /// status there); returns the log if the process exits first.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + STARTUP_LIMIT;
        let pid_file = self.data.join("postmaster.pid");
        loop {
            if let Ok(text) = fs::read_to_string(&pid_file) {
                if text.lines().nth(7).map(str::trim) == Some("ready") {
                    return Ok(());
                }
            }
            let child = self.child.as_mut().unwrap();
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return Err(format!("exited with {status}:\n{}", self.log()));
            }
            assert!(
                Instant::now() < deadline,
                "postgres did not become ready in {STARTUP_LIMIT:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Signals the postmaster (the pid in its pid file: under `runuser` our child is
    /// not the postmaster itself).
    fn signal(&self, signal: &str) {
        let Ok(text) = fs::read_to_string(self.data.join("postmaster.pid")) else {
            return;
        };
        let Some(pid) = text.lines().next().map(str::trim) else {
            return;
        };
        let _ = Command::new("kill")
            .args([&format!("-{signal}"), pid])
            .stderr(Stdio::null())
            .status();
    }

    /// Waits for the server process to exit; kills it after `limit`.
    fn reap(&mut self, limit: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let deadline = Instant::now() + limit;
        loop {
            if child.try_wait().unwrap().is_some() {
                return;
            }
            if Instant::now() >= deadline {
                self.signal("KILL");
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `program` from the PostgreSQL bin dir, run as the server's user.
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        match self.run_as {
            None => Command::new(program),
            Some(user) if Path::new("/usr/sbin/runuser").exists() || in_path("runuser") => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(program);
                command
            }
            Some(user) => {
                // `su` takes one shell command line; `exec` keeps the process count down.
                let mut command = Command::new("su");
                command.args([user, "-s", "/bin/sh", "-c", "exec \"$0\" \"$@\""]);
                command.arg(program);
                command
            }
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        // Immediate shutdown: the test is over, nothing needs to be flushed.
        if self.child.is_some() {
            self.signal("QUIT");
            self.reap(Duration::from_secs(10));
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// The PostgreSQL bin dir: `PG_BIN`, else the newest `/usr/lib/postgresql/*/bin`.
fn pg_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN").filter(|dir| !dir.is_empty()) {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("initdb").exists() && dir.join("postgres").exists(),
            "PG_BIN={} holds no initdb/postgres; run ./scripts/test, which installs \
             postgresql, or point PG_BIN at the PostgreSQL bin directory",
            dir.display()
        );
        return dir;
    }
    let newest = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .max();
    match newest {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL is not installed (no initdb under /usr/lib/postgresql/*/bin and \
             PG_BIN is unset): run ./scripts/test, which installs postgresql, or set PG_BIN \
             to the directory holding initdb and postgres"
        ),
    }
}

pub fn is_root() -> bool {
    let output = Command::new("id")
        .arg("-u")
        .output()
        .expect("cannot run id");
    String::from_utf8_lossy(&output.stdout).trim() == "0"
}

fn in_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).exists()))
}

fn id_of(user: &str, flag: &str) -> u32 {
    let output = Command::new("id")
        .args([flag, user])
        .output()
        .expect("cannot run id");
    assert!(
        output.status.success(),
        "there is no `{user}` system user to run PostgreSQL as (we are root, and \
         PostgreSQL refuses to run as root); run ./scripts/test, which installs postgresql"
    );
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap()
}

pub fn chown_to(path: &Path, user: &str) {
    std::os::unix::fs::chown(path, Some(id_of(user, "-u")), Some(id_of(user, "-g")))
        .expect("cannot chown the server dir");
}

pub fn temp_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let dir = std::env::temp_dir().join(format!(
        "tower-keyed-lock-pg-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir(&dir).expect("cannot create the server dir");
    dir
}
