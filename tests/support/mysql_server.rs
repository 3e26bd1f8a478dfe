//! A throwaway MariaDB server for the tests and benches: `mariadb-install-db` into a
//! temp dir, `mariadbd` on a free port of 127.0.0.1, stopped and removed on drop.
//!
//! The binaries come from `MARIADB_BIN` (a directory holding `mariadbd` and
//! `mariadb-install-db`), else the system's (`./scripts/test` installs the
//! `mariadb-server` package). A system instance on port 3306 is never touched: each
//! server has its own data dir, socket and free port, and reads no option file
//! (`--no-defaults`). Under root the server runs as root (`--user=root`).
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::ports::free_port;

/// How long a start or stop may take before the test fails.
const STARTUP_LIMIT: Duration = Duration::from_secs(60);

pub struct MySqlServer {
    /// The temp dir: the data dir, the socket, the pid file and the log live here.
    root: PathBuf,
    data: PathBuf,
    log: PathBuf,
    server: PathBuf,
    port: u16,
    /// The `mariadbd` process; `None` while stopped.
    child: Option<Child>,
    paused: bool,
}

/// The database the tests use (created at start).
pub const DATABASE: &str = "locks";

impl MySqlServer {
    /// Initializes a data dir in a fresh temp dir and starts the server on a free port.
    pub fn start() -> MySqlServer {
        let (server_bin, install_db) = binaries();
        let root = temp_dir();
        let data = root.join("data");
        let log = root.join("mariadb.log");
        // A temp dir of its own: servers that share one collide on their temp files.
        let tmp = root.join("tmp");
        fs::create_dir(&tmp).expect("cannot create the server's temp dir");
        let output = Command::new(&install_db)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg("--auth-root-authentication-method=normal")
            .arg("--skip-test-db")
            .arg(format!("--user={}", whoami()))
            // Passed on to the bootstrap server.
            .arg(format!("--tmpdir={}", tmp.display()))
            .arg("--innodb-log-file-size=16M")
            .output()
            .expect("cannot run mariadb-install-db");
        if !output.status.success() {
            let _ = fs::remove_dir_all(&root);
        }
        assert!(
            output.status.success(),
            "mariadb-install-db failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let mut server = MySqlServer {
            root,
            data,
            log,
            server: server_bin,
            port: free_port(),
            child: None,
            paused: false,
        };
        // Another process may take the port between our probe and the bind: then try
        // another one.
        for _ in 0..3 {
            match server.spawn() {
                Ok(()) => {
                    server.admin(&format!("CREATE DATABASE {DATABASE}"));
                    return server;
                }
                Err(log) if log.contains("Address already in use") || log.contains("bind") => {
                    server.port = free_port();
                }
                Err(log) => panic!("mariadbd did not start:\n{log}"),
            }
        }
        panic!("mariadbd found no free port:\n{}", server.log());
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of the test database for the root user, on TCP.
    pub fn url(&self) -> String {
        self.url_via(&format!("127.0.0.1:{}", self.port))
    }

    /// The URL of the test database through `host_port` (a proxy).
    pub fn url_via(&self, host_port: &str) -> String {
        // `prefer_socket=false`: the driver would otherwise switch to the server's Unix
        // socket, around any proxy.
        format!("mysql://root@{host_port}/{DATABASE}?prefer_socket=false")
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Runs `sql` as root with the `mariadb` client over the socket; panics on failure.
    pub fn admin(&self, sql: &str) -> String {
        let output = Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", self.socket().display()))
            .args(["-uroot", "-N", "-B", "-e", sql])
            .output()
            .expect("cannot run the mariadb client");
        assert!(
            output.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Starts the (stopped) server again on the same port and data dir.
    pub fn start_again(&mut self) {
        if let Err(log) = self.spawn() {
            panic!("mariadbd did not start again:\n{log}");
        }
    }

    /// A clean shutdown (every session ends, as in a restart); returns once the server
    /// has exited.
    pub fn stop(&mut self) {
        self.resume();
        self.signal("TERM");
        self.reap(STARTUP_LIMIT);
    }

    /// SIGKILL: a crash. Returns once the process is gone.
    pub fn kill(&mut self) {
        self.resume();
        self.signal("KILL");
        self.reap(STARTUP_LIMIT);
    }

    /// SIGSTOP: the server answers nothing, and its sockets stay open.
    pub fn pause(&mut self) {
        if self.child.is_some() && !self.paused {
            self.signal("STOP");
            self.paused = true;
        }
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&mut self) {
        if self.paused {
            self.signal("CONT");
            self.paused = false;
        }
    }

    fn socket(&self) -> PathBuf {
        self.root.join("mariadb.sock")
    }

    /// Starts the server; returns once it accepts connections, or the log if it
    /// exited.
    fn spawn(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "the server is already running");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("cannot open the server log");
        let _ = fs::remove_file(self.socket());
        let child = Command::new(&self.server)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", self.data.display()))
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!(
                "--pid-file={}",
                self.root.join("mariadb.pid").display()
            ))
            .arg(format!("--tmpdir={}", self.root.join("tmp").display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--user={}", whoami()))
            .args([
                "--skip-name-resolve",
                "--skip-log-bin",
                "--performance-schema=OFF",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=16M",
                // Keeps every committed increment across a server crash (the fencing
                // counter test kills the server); only an OS crash could lose some.
                "--innodb-flush-log-at-trx-commit=2",
                "--max-connections=200",
                "--log-warnings=1",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("cannot start mariadbd");
        self.child = Some(child);
        self.wait_ready()
    }

    /// Polls the TCP port until the server answers a query; returns the log if the
    /// process exits first.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + STARTUP_LIMIT;
        loop {
            let ready = Command::new("mariadb")
                .arg("--no-defaults")
                .arg(format!("--socket={}", self.socket().display()))
                .args(["-uroot", "-e", "SELECT 1"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success());
            if ready {
                return Ok(());
            }
            let child = self.child.as_mut().unwrap();
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return Err(format!("exited with {status}:\n{}", self.log()));
            }
            assert!(
                Instant::now() < deadline,
                "mariadbd did not become ready in {STARTUP_LIMIT:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .args([&format!("-{signal}"), &child.id().to_string()])
                .stderr(Stdio::null())
                .status();
        }
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
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for MySqlServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.resume();
            self.signal("KILL");
            self.reap(Duration::from_secs(10));
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// `mariadbd` and `mariadb-install-db`: from `MARIADB_BIN`, else the system's.
fn binaries() -> (PathBuf, PathBuf) {
    if let Some(dir) = std::env::var_os("MARIADB_BIN").filter(|dir| !dir.is_empty()) {
        let dir = PathBuf::from(dir);
        let (server, install) = (dir.join("mariadbd"), dir.join("mariadb-install-db"));
        assert!(
            server.exists() && install.exists(),
            "MARIADB_BIN={} holds no mariadbd/mariadb-install-db; run ./scripts/test, \
             which installs mariadb-server",
            dir.display()
        );
        return (server, install);
    }
    let find = |names: &[&str], dirs: &[&str]| {
        names.iter().find_map(|name| {
            dirs.iter()
                .map(|dir| Path::new(dir).join(name))
                .find(|path| path.exists())
        })
    };
    let dirs = ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"];
    match (
        find(&["mariadbd", "mysqld"], &dirs),
        find(&["mariadb-install-db", "mysql_install_db"], &dirs),
    ) {
        (Some(server), Some(install)) => (server, install),
        _ => panic!(
            "MariaDB is not installed (no mariadbd or mariadb-install-db under /usr/sbin or \
             /usr/bin, and MARIADB_BIN is unset): run ./scripts/test, which installs \
             mariadb-server, or set MARIADB_BIN to the directory holding both"
        ),
    }
}

fn whoami() -> String {
    let output = Command::new("id")
        .arg("-un")
        .output()
        .expect("cannot run id");
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

fn temp_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let dir = std::env::temp_dir().join(format!(
        "tower-keyed-lock-mariadb-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir(&dir).expect("cannot create the server dir");
    dir
}
