//! A throwaway PgBouncer in front of a [`PgServer`]: a generated ini and auth file in a
//! temp dir, a free port of 127.0.0.1, stopped and removed on drop.
//!
//! The binary is `PGBOUNCER`, else `/usr/sbin/pgbouncer` or `pgbouncer` on the `PATH`
//! (`scripts/test --install` installs it). PgBouncer refuses to run as root, so under root it
//! runs as the `postgres` system user, as the server does.
#![allow(dead_code)]

use std::fs;
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::pg_server::{as_user, chown_to, is_root, PgServer};
use super::process::{find_program, missing, ServerProcess, TempDir};

/// PgBouncer's `pool_mode`.
#[derive(Clone, Copy, Debug)]
pub enum PoolMode {
    Session,
    Transaction,
    Statement,
}

impl PoolMode {
    fn ini_value(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
            PoolMode::Statement => "statement",
        }
    }
}

pub struct PgBouncer {
    /// Its directory holds the ini, the auth file, the pid file and the log.
    process: ServerProcess,
}

impl PgBouncer {
    /// Starts PgBouncer in `mode`, with at most `pool_size` server connections, in
    /// front of `pg`; returns once it accepts connections.
    pub fn start(pg: &PgServer, mode: PoolMode, pool_size: usize) -> PgBouncer {
        Self::start_with(pg, mode, pool_size, &[])
    }

    /// [`start`](Self::start) with more `[pgbouncer]` settings (`server_reset_query`,
    /// `server_reset_query_always`, ...).
    pub fn start_with(
        pg: &PgServer,
        mode: PoolMode,
        pool_size: usize,
        settings: &[(&str, &str)],
    ) -> PgBouncer {
        let bin = pgbouncer_bin();
        let root = TempDir::new("pgbouncer");
        let run_as = is_root().then_some("postgres");
        let mode = mode.ini_value();
        let extra: String = settings
            .iter()
            .map(|(name, value)| format!("{name} = {value}\n"))
            .collect();
        let pg_port = pg.port();
        let pid_file = root.path().join("pgbouncer.pid");
        let process = ServerProcess::new("pgbouncer", root)
            .command(move |process| {
                let root = process.dir();
                fs::write(root.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
                // No `logfile`: PgBouncer in the foreground logs to stderr, the log.
                let ini = format!(
                    "[databases]\n\
                     postgres = host=127.0.0.1 port={pg_port} dbname=postgres\n\
                     [pgbouncer]\n\
                     listen_addr = 127.0.0.1\n\
                     listen_port = {port}\n\
                     unix_socket_dir =\n\
                     auth_type = trust\n\
                     auth_file = {root}/users.txt\n\
                     pool_mode = {mode}\n\
                     default_pool_size = {pool_size}\n\
                     max_client_conn = 200\n\
                     pidfile = {root}/pgbouncer.pid\n\
                     {extra}",
                    port = process.port(),
                    root = root.display(),
                );
                fs::write(root.join("pgbouncer.ini"), ini).unwrap();
                if let Some(user) = run_as {
                    for file in ["", "users.txt", "pgbouncer.ini"] {
                        chown_to(&root.join(file), user);
                    }
                }
                let mut command = as_user(run_as, bin.clone());
                command.arg(root.join("pgbouncer.ini"));
                command
            })
            .ready_when(|process| TcpStream::connect(("127.0.0.1", process.port())).is_ok())
            // Under `runuser` our child is not PgBouncer itself.
            .pid_file(pid_file)
            .start(3);
        PgBouncer { process }
    }

    /// Switches the running PgBouncer to `mode` (the ini rewritten, then `SIGHUP`):
    /// clients connected now are pooled the new way from their next transaction on.
    /// Returns once the log shows the reload.
    pub fn set_pool_mode(&self, mode: PoolMode) {
        let ini = self.process.dir().join("pgbouncer.ini");
        let config = fs::read_to_string(&ini).unwrap();
        let config: String = config
            .lines()
            .map(|line| match line.starts_with("pool_mode = ") {
                true => format!("pool_mode = {}\n", mode.ini_value()),
                false => format!("{line}\n"),
            })
            .collect();
        fs::write(&ini, config).unwrap();
        let reloads = || self.log().matches("got SIGHUP, re-reading config").count();
        let before = reloads();
        if !self.process.signal("HUP") {
            self.process.fail("cannot signal it (SIGHUP)");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while reloads() == before {
            if Instant::now() > deadline {
                self.process.fail("did not reload in 10 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A connection string for the `postgres` user through PgBouncer.
    pub fn conn_str(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.process.port()
        )
    }

    pub fn log(&self) -> String {
        self.process.log()
    }
}

/// `PGBOUNCER`, else `/usr/sbin/pgbouncer`, else `pgbouncer` on the `PATH`.
fn pgbouncer_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("PGBOUNCER").filter(|bin| !bin.is_empty()) {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            missing(&format!("PGBOUNCER={}", bin.display()), "");
        }
        return bin;
    }
    find_program(&["pgbouncer"], &["/usr/sbin"])
        .unwrap_or_else(|| missing("`pgbouncer`", ", or set PGBOUNCER to its path"))
}
