//! A throwaway PostgreSQL server for the tests and benches: `initdb` into a temp dir,
//! `postgres` on a free port of 127.0.0.1, stopped and removed on drop.
//!
//! The binaries come from `PG_BIN`, else the newest `/usr/lib/postgresql/*/bin`
//! (`scripts/test --install` installs them). PostgreSQL refuses to run as root, so under root
//! the server runs as the `postgres` system user (`runuser`, else `su`), in a temp dir
//! that user owns.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::process::{find_program, missing, ServerProcess, TempDir};

/// How long a start or stop may take before the test fails.
const STARTUP_LIMIT: Duration = Duration::from_secs(30);

pub struct PgServer {
    /// Its directory holds the data dir, the socket and the log.
    process: ServerProcess,
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
        let root = TempDir::new("pg");
        if let Some(user) = run_as {
            chown_to(root.path(), user);
        }
        let data = root.path().join("data");
        let output = as_user(run_as, bin.join("initdb"))
            .arg("-D")
            .arg(&data)
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
        let pid_file = data.join("postmaster.pid");
        let (ready_file, root_pid_file) = (pid_file.clone(), pid_file.clone());
        let process = ServerProcess::new("postgres", root)
            .command(move |process| {
                // A stale pid file would make the readiness check pass too early.
                let _ = fs::remove_file(&pid_file);
                let mut command = as_user(run_as, bin.join("postgres"));
                command
                    .arg("-D")
                    .arg(&data)
                    .args(["-p", &process.port().to_string()])
                    .arg("-k")
                    .arg(process.dir())
                    .args(["-c", "listen_addresses=127.0.0.1"])
                    .args(["-c", "fsync=off"])
                    .args(["-c", "synchronous_commit=off"])
                    .args(["-c", "full_page_writes=off"])
                    .args(["-c", "shared_buffers=16MB"])
                    .arg("-c")
                    .arg(format!("max_connections={max_connections}"))
                    // `%a` (application name) lets a test attribute logged statements.
                    .args(["-c", "log_line_prefix=%m [%p] %a: "]);
                command
            })
            // The postmaster writes its status to the pid file: `ready` on line 8.
            .ready_when(move |_| {
                fs::read_to_string(&ready_file)
                    .is_ok_and(|text| text.lines().nth(7).map(str::trim) == Some("ready"))
            })
            .ready_within(STARTUP_LIMIT)
            // Under `runuser` our child is not the postmaster: signals go to the pid it
            // writes.
            .pid_file(root_pid_file)
            // Immediate shutdown: the test is over, nothing needs to be flushed.
            .shutdown_signal("QUIT")
            .start(3);
        PgServer { process }
    }

    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// A libpq-style connection string for the `postgres` superuser.
    pub fn conn_str(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port()
        )
    }

    /// Everything the server logged so far.
    pub fn log(&self) -> String {
        self.process.log()
    }

    pub fn is_running(&self) -> bool {
        self.process.is_running()
    }

    /// Starts the (stopped) server again on the same port and data dir; returns once
    /// it accepts connections.
    pub fn start_again(&mut self) {
        self.process.start_again();
    }

    /// Fast shutdown (sessions are terminated, as in a restart); returns once the
    /// server has exited and the port is closed.
    pub fn stop(&mut self) {
        self.process.stop("INT", STARTUP_LIMIT);
    }
}

/// `program`, run as `user` if given (`runuser`, else `su`).
pub fn as_user(user: Option<&str>, program: PathBuf) -> Command {
    let Some(user) = user else {
        return Command::new(program);
    };
    if Path::new("/usr/sbin/runuser").exists() || find_program(&["runuser"], &[]).is_some() {
        let mut command = Command::new("runuser");
        command.args(["-u", user, "--"]).arg(program);
        return command;
    }
    // `su` takes one shell command line; `exec` keeps the process count down.
    let mut command = Command::new("su");
    command.args([user, "-s", "/bin/sh", "-c", "exec \"$0\" \"$@\""]);
    command.arg(program);
    command
}

/// The PostgreSQL bin dir: `PG_BIN`, else the newest `/usr/lib/postgresql/*/bin`.
fn pg_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN").filter(|dir| !dir.is_empty()) {
        let dir = PathBuf::from(dir);
        if !(dir.join("initdb").exists() && dir.join("postgres").exists()) {
            missing(
                &format!(
                    "PostgreSQL's `initdb` and `postgres` in PG_BIN={}",
                    dir.display()
                ),
                " (package postgresql), or point PG_BIN at the PostgreSQL bin directory",
            );
        }
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
        None => missing(
            "PostgreSQL's `initdb` (under /usr/lib/postgresql/*/bin, PG_BIN unset)",
            " (package postgresql), or set PG_BIN to the directory holding initdb and \
             postgres",
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

fn id_of(user: &str, flag: &str) -> u32 {
    let output = Command::new("id")
        .args([flag, user])
        .output()
        .expect("cannot run id");
    assert!(
        output.status.success(),
        "there is no `{user}` system user to run PostgreSQL as (we are root, and \
         PostgreSQL refuses to run as root); run `scripts/test --install`, which installs \
         postgresql and creates it"
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
