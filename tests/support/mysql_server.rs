//! A throwaway MariaDB server for the tests and benches: `mariadb-install-db` into a
//! temp dir, `mariadbd` on a free port of 127.0.0.1, stopped and removed on drop.
//!
//! The binaries come from `MARIADB_BIN` (a directory holding `mariadbd` and
//! `mariadb-install-db`), else the system's (`scripts/test --install` installs the
//! `mariadb-server` package). A system instance on port 3306 is never touched: each
//! server has its own data dir, socket and free port, and reads no option file
//! (`--no-defaults`). Under root the server runs as root (`--user=root`).
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::process::{find_program, missing, runs, ServerProcess, TempDir};

/// How long a start or stop may take before the test fails.
const STARTUP_LIMIT: Duration = Duration::from_secs(60);

pub struct MySqlServer {
    /// Its directory holds the data dir, the socket, the pid file and the log.
    process: ServerProcess,
}

/// The database the tests use (created at start).
pub const DATABASE: &str = "locks";

impl MySqlServer {
    /// Initializes a data dir in a fresh temp dir and starts the server on a free port.
    pub fn start() -> MySqlServer {
        let (server_bin, install_db) = binaries();
        let root = TempDir::new("mariadb");
        let data = root.path().join("data");
        // A temp dir of its own: servers that share one collide on their temp files.
        let tmp = root.path().join("tmp");
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
        assert!(
            output.status.success(),
            "mariadb-install-db failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let client_socket = format!("--socket={}", socket(root.path()).display());
        let process = ServerProcess::new("mariadbd", root)
            .command(move |process| {
                let root = process.dir();
                let _ = fs::remove_file(socket(root));
                let mut command = Command::new(&server_bin);
                command
                    .arg("--no-defaults")
                    .arg(format!("--datadir={}", data.display()))
                    .arg(format!("--socket={}", socket(root).display()))
                    .arg(format!("--pid-file={}", root.join("mariadb.pid").display()))
                    .arg(format!("--tmpdir={}", tmp.display()))
                    .arg(format!("--port={}", process.port()))
                    .arg("--bind-address=127.0.0.1")
                    .arg(format!("--user={}", whoami()))
                    .args([
                        "--skip-name-resolve",
                        "--skip-log-bin",
                        "--performance-schema=OFF",
                        "--innodb-buffer-pool-size=32M",
                        "--innodb-log-file-size=16M",
                        // Keeps every committed increment across a server crash (the
                        // fencing counter test kills the server); only an OS crash could
                        // lose some.
                        "--innodb-flush-log-at-trx-commit=2",
                        "--max-connections=200",
                        "--log-warnings=1",
                    ]);
                command
            })
            // Ready once it answers a query (the client is a process: polled less often).
            .ready_when(move |_| {
                runs(
                    "mariadb",
                    &["--no-defaults", &client_socket, "-uroot", "-e", "SELECT 1"],
                )
            })
            .ready_within(STARTUP_LIMIT)
            .poll_every(Duration::from_millis(50))
            .start(3);
        let server = MySqlServer { process };
        server.admin(&format!("CREATE DATABASE {DATABASE}"));
        server
    }

    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// The URL of the test database for the root user, on TCP.
    pub fn url(&self) -> String {
        self.url_via(&format!("127.0.0.1:{}", self.port()))
    }

    /// The URL of the test database through `host_port` (a proxy).
    pub fn url_via(&self, host_port: &str) -> String {
        // `prefer_socket=false`: the driver would otherwise switch to the server's Unix
        // socket, around any proxy.
        format!("mysql://root@{host_port}/{DATABASE}?prefer_socket=false")
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        self.process.log()
    }

    pub fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// Runs `sql` as root with the `mariadb` client over the socket; panics on failure.
    pub fn admin(&self, sql: &str) -> String {
        let output = Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", socket(self.process.dir()).display()))
            .args(["-uroot", "-N", "-B", "-e", sql])
            .stdin(Stdio::null())
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
        self.process.start_again();
    }

    /// A clean shutdown (every session ends, as in a restart); returns once the server
    /// has exited.
    pub fn stop(&mut self) {
        self.process.stop("TERM", STARTUP_LIMIT);
    }

    /// SIGKILL: a crash. Returns once the process is gone.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGSTOP: the server answers nothing, and its sockets stay open.
    pub fn pause(&mut self) {
        self.process.pause();
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&mut self) {
        self.process.resume();
    }
}

/// The server's socket in its directory `root`.
fn socket(root: &Path) -> PathBuf {
    root.join("mariadb.sock")
}

/// `mariadbd` and `mariadb-install-db`: from `MARIADB_BIN`, else the system's.
fn binaries() -> (PathBuf, PathBuf) {
    if let Some(dir) = std::env::var_os("MARIADB_BIN").filter(|dir| !dir.is_empty()) {
        let dir = PathBuf::from(dir);
        let (server, install) = (dir.join("mariadbd"), dir.join("mariadb-install-db"));
        if !(server.exists() && install.exists()) {
            missing(
                &format!(
                    "`mariadbd` and `mariadb-install-db` in MARIADB_BIN={}",
                    dir.display()
                ),
                " (package mariadb-server)",
            );
        }
        return (server, install);
    }
    let dirs = ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"];
    match (
        find_program(&["mariadbd", "mysqld"], &dirs),
        find_program(&["mariadb-install-db", "mysql_install_db"], &dirs),
    ) {
        (Some(server), Some(install)) => (server, install),
        _ => missing(
            "MariaDB's `mariadbd` and `mariadb-install-db`",
            " (package mariadb-server), or set MARIADB_BIN to the directory holding both",
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
