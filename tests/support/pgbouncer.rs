//! A throwaway PgBouncer in front of a [`PgServer`]: a generated ini and auth file in a
//! temp dir, a free port of 127.0.0.1, stopped and removed on drop.
//!
//! The binary is `PGBOUNCER`, else `/usr/sbin/pgbouncer` or `pgbouncer` on the `PATH`
//! (`./scripts/test` installs it). PgBouncer refuses to run as root, so under root it
//! runs as the `postgres` system user, as the server does.
#![allow(dead_code)]

use std::fs;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::pg_server::{chown_to, free_port, is_root, temp_dir, PgServer};

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
    root: PathBuf,
    port: u16,
    child: Child,
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
        let root = temp_dir();
        let run_as = is_root().then_some("postgres");
        let port = free_port();
        let mode = mode.ini_value();
        fs::write(root.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        let extra: String = settings
            .iter()
            .map(|(name, value)| format!("{name} = {value}\n"))
            .collect();
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
             logfile = {root}/pgbouncer.log\n\
             pidfile = {root}/pgbouncer.pid\n\
             {extra}",
            pg_port = pg.port(),
            root = root.display(),
        );
        fs::write(root.join("pgbouncer.ini"), ini).unwrap();
        if let Some(user) = run_as {
            for file in ["", "users.txt", "pgbouncer.ini"] {
                chown_to(&root.join(file), user);
            }
        }
        let mut command = match run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(&bin);
                command
            }
            None => Command::new(&bin),
        };
        let child = command
            .arg(root.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start pgbouncer");
        let mut bouncer = PgBouncer { root, port, child };
        bouncer.wait_ready();
        bouncer
    }

    /// Switches the running PgBouncer to `mode` (the ini rewritten, then `SIGHUP`):
    /// clients connected now are pooled the new way from their next transaction on.
    /// Returns once the log shows the reload.
    pub fn set_pool_mode(&self, mode: PoolMode) {
        let ini = self.root.join("pgbouncer.ini");
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
        let pid = fs::read_to_string(self.root.join("pgbouncer.pid")).unwrap();
        let status = Command::new("kill")
            .args(["-HUP", pid.trim()])
            .status()
            .unwrap();
        assert!(status.success(), "cannot signal pgbouncer");
        let deadline = Instant::now() + Duration::from_secs(10);
        while reloads() == before {
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not reload in 10 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A connection string for the `postgres` user through PgBouncer.
    pub fn conn_str(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.root.join("pgbouncer.log")).unwrap_or_default()
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("pgbouncer exited with {status}:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not listen in 10 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // Under `runuser` our child is not PgBouncer itself: signal the pid it wrote.
        if let Ok(pid) = fs::read_to_string(self.root.join("pgbouncer.pid")) {
            let _ = Command::new("kill")
                .args(["-INT", pid.trim()])
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// `PGBOUNCER`, else `/usr/sbin/pgbouncer`, else `pgbouncer` on the `PATH`.
fn pgbouncer_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("PGBOUNCER").filter(|bin| !bin.is_empty()) {
        return PathBuf::from(bin);
    }
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    let candidates = std::iter::once(PathBuf::from("/usr/sbin/pgbouncer"))
        .chain(on_path.into_iter().map(|dir| dir.join("pgbouncer")));
    for candidate in candidates {
        if candidate.exists() {
            return candidate;
        }
    }
    panic!(
        "PgBouncer is not installed (no /usr/sbin/pgbouncer, none on the PATH, PGBOUNCER \
         unset): run ./scripts/test, which installs it, or set PGBOUNCER to its path"
    );
}
