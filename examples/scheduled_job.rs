//! A scheduled job that must run on one instance of three: `DistributedLocks::try_lock`.
//!
//! Three "instances" — threads, each with its own tokio runtime and its own Redis
//! connections — fire the same job every second. Each tick, one of them gets the key
//! and runs the job; the others get `LockError::Busy` and skip. Then the instance
//! running the job crashes in the middle of it (its runtime is shut down: the lease is
//! neither renewed nor released), and another instance takes over once the 1.5 s lease
//! has run out.
//!
//! Run it with `cargo run --features redis --example scheduled_job`. It starts its own
//! `redis-server` on a free port (and stops it at the end); without `redis-server`, or
//! without the `redis` feature, it says so and the three instances share the
//! in-process lock instead. It checks what it shows and exits non-zero otherwise: every
//! tick before the crash ran exactly once, the job's writes carry increasing fencing
//! tokens, and the takeover came within the lease.
//!
//! With `cargo run --features mysql --example scheduled_job -- --mysql` the instances
//! share a MariaDB server instead (`MySqlBackend`, `GET_LOCK`), which the example
//! starts on a free port with a data dir of its own (it needs `mariadb-server`
//! installed). A session lock ends with its connection: the crash closes the crashed
//! instance's connections, the server frees the key at once, and the next tick takes
//! over with a newer fencing token.

use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tower_keyed_lock::{DistributedGuard, DistributedLocks, LockError};

/// The schedule: a tick every second.
const TICK: Duration = Duration::from_secs(1);
/// Ticks that run normally; the next one crashes.
const NORMAL_TICKS: u64 = 3;
const CRASH_TICK: u64 = NORMAL_TICKS + 1;
/// The last tick fired while waiting for the takeover.
const LAST_TICK: u64 = CRASH_TICK + 3;
/// How long the job takes: the other instances fire their tick meanwhile.
const JOB: Duration = Duration::from_millis(400);
/// The Redis lease: how long a crashed instance keeps the job's key.
const LEASE: Duration = Duration::from_millis(1500);
const JOB_KEY: &str = "nightly-report";

/// What the job writes: the storage a real job would update, fenced by token.
#[derive(Default)]
struct Ledger {
    runs: Vec<Run>,
    crash: Option<(usize, Instant, Option<u64>)>,
    last_token: Option<u64>,
}

struct Run {
    tick: u64,
    instance: usize,
    fencing_token: Option<u64>,
    at: Instant,
}

impl Ledger {
    /// Records a run, refusing a stale fencing token as real storage would.
    fn write(&mut self, run: Run) {
        if let (Some(last), Some(token)) = (self.last_token, run.fencing_token) {
            assert!(token > last, "stale write: token {token} after {last}");
        }
        self.last_token = run.fencing_token.or(self.last_token);
        self.runs.push(run);
    }

    fn took_over(&self) -> bool {
        self.runs.iter().any(|run| run.tick > CRASH_TICK)
    }
}

/// How the instances reach each other.
enum Shared {
    #[cfg(feature = "redis")]
    Redis(String),
    #[cfg(feature = "mysql")]
    MySql(String),
    InProcess(DistributedLocks),
}

impl Shared {
    async fn locks(&self) -> DistributedLocks {
        match self {
            #[cfg(feature = "redis")]
            Shared::Redis(url) => {
                let client = redis::Client::open(url.as_str()).expect("a valid Redis URL");
                let backend = tower_keyed_lock::RedisBackend::builder(client)
                    .lease(LEASE)
                    // The example starts its own empty server; a deployment keeps the
                    // guard, which holds grants back for a lease after Redis restarts.
                    .restart_guard(false)
                    .build()
                    .await
                    .expect("the instance connects to Redis");
                DistributedLocks::new("cron", backend)
            }
            #[cfg(feature = "mysql")]
            Shared::MySql(url) => {
                let backend = tower_keyed_lock::MySqlBackend::from_url(url)
                    .expect("a valid MySQL URL")
                    .fencing(true);
                DistributedLocks::new("cron", backend)
            }
            Shared::InProcess(locks) => locks.clone(),
        }
    }
}

fn main() {
    if std::env::args().any(|arg| arg == "--mysql") {
        #[cfg(feature = "mysql")]
        {
            let server = mysql_process::MariaDb::start();
            println!("mariadbd started on port {}", server.port);
            let shared = Arc::new(Shared::MySql(server.url()));
            let ledger = run(shared);
            check(&ledger, Takeover::AtOnce);
            println!("ok: every tick ran once, and the crashed job was taken over");
            return;
        }
        #[cfg(not(feature = "mysql"))]
        panic!("--mysql needs the `mysql` feature: cargo run --features mysql --example scheduled_job -- --mysql");
    }
    #[cfg(feature = "redis")]
    let redis = redis_process::RedisProcess::start();
    #[cfg(feature = "redis")]
    let shared = match &redis {
        Some(redis) => {
            println!("redis-server started on port {}", redis.port);
            Shared::Redis(format!("redis://127.0.0.1:{}/", redis.port))
        }
        None => in_process("redis-server is not installed"),
    };
    #[cfg(not(feature = "redis"))]
    let shared = in_process("built without the `redis` feature");
    let shared = Arc::new(shared);
    let takeover = match *shared {
        Shared::InProcess(_) => Takeover::AtOnce,
        _ => Takeover::AfterTheLease,
    };
    let ledger = run(shared);
    check(&ledger, takeover);
    println!("ok: every tick ran once, and the crashed job was taken over");
}

/// When the crashed job's key comes back.
#[derive(Clone, Copy)]
enum Takeover {
    /// A lease: when it runs out.
    AfterTheLease,
    /// A session lock (or the in-process lock): with the crashed instance's connection
    /// (or guard), so the next tick takes over.
    AtOnce,
}

/// Runs the three instances to their end; returns what their jobs wrote.
fn run(shared: Arc<Shared>) -> Ledger {
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let start = Instant::now() + Duration::from_millis(200);
    let instances: Vec<_> = (1..=3)
        .map(|id| {
            let (shared, ledger) = (shared.clone(), ledger.clone());
            thread::spawn(move || run_instance(id, shared, ledger, start))
        })
        .collect();
    for instance in instances {
        instance.join().expect("an instance panicked");
    }
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    ledger
}

fn in_process(why: &str) -> Shared {
    println!(
        "{why}: the three instances share the in-process lock instead \
         (one process: no leases, no fencing tokens; a crash frees the key at once)"
    );
    Shared::InProcess(DistributedLocks::in_process("cron"))
}

/// One instance: a thread with a runtime of its own, which it shuts down without any
/// cleanup when its job "crashes".
fn run_instance(id: usize, shared: Arc<Shared>, ledger: Arc<Mutex<Ledger>>, start: Instant) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (crash, crashed) = mpsc::channel();
    let schedule = runtime.spawn(schedule(id, shared, ledger, start, crash));
    // The sender is dropped when the schedule ends; a message means "crash now".
    if crashed.recv().is_ok() {
        // Like a killed process: the tasks stop where they are, nothing is released.
        runtime.shutdown_background();
        println!("  instance {id} crashed in the middle of tick {CRASH_TICK}");
        return;
    }
    runtime.block_on(schedule).expect("the schedule panicked");
}

async fn schedule(
    id: usize,
    shared: Arc<Shared>,
    ledger: Arc<Mutex<Ledger>>,
    start: Instant,
    crash: mpsc::Sender<()>,
) {
    let locks = shared.locks().await;
    for tick in 1..=LAST_TICK {
        tokio::time::sleep_until((start + TICK * tick as u32).into()).await;
        if tick > CRASH_TICK && ledger.lock().unwrap().took_over() {
            return;
        }
        match locks.try_lock(JOB_KEY).await {
            Ok(guard) if tick == CRASH_TICK => {
                let token = guard.fencing_token();
                println!("tick {tick}: instance {id} runs the job (token {token:?})");
                tokio::time::sleep(JOB / 2).await;
                ledger.lock().unwrap().crash = Some((id, Instant::now(), token));
                // The guard stays alive: the crash stops this runtime with it held.
                crash.send(()).unwrap();
                let _held = guard;
                std::future::pending::<()>().await;
            }
            Ok(guard) => run_job(id, tick, guard, &ledger).await,
            Err(LockError::Busy) => println!("  tick {tick}: instance {id} skips (busy)"),
            Err(error) => panic!("instance {id}, tick {tick}: {error}"),
        }
    }
}

async fn run_job(id: usize, tick: u64, guard: DistributedGuard, ledger: &Mutex<Ledger>) {
    let token = guard.fencing_token();
    println!("tick {tick}: instance {id} runs the job (token {token:?})");
    let work = async {
        tokio::time::sleep(JOB).await;
        ledger.lock().unwrap().write(Run {
            tick,
            instance: id,
            fencing_token: token,
            at: Instant::now(),
        });
    };
    guard
        .run_while_held(work)
        .await
        .expect("the lease held during the job");
    guard.release().await;
}

/// Asserts what the example claims.
fn check(ledger: &Ledger, expected: Takeover) {
    for tick in 1..=NORMAL_TICKS {
        let runs: Vec<_> = ledger.runs.iter().filter(|r| r.tick == tick).collect();
        assert_eq!(runs.len(), 1, "tick {tick} ran {} times", runs.len());
    }
    let (crashed, crashed_at, crash_token) = ledger.crash.expect("the crash tick ran");
    let takeover = ledger
        .runs
        .iter()
        .find(|run| run.tick > CRASH_TICK)
        .expect("another instance took over");
    assert_ne!(takeover.instance, crashed, "a crashed instance cannot run");
    let after = takeover.at.duration_since(crashed_at);
    println!(
        "instance {} took over at tick {}, {after:?} after the crash",
        takeover.instance, takeover.tick
    );
    let ticks: Vec<u64> = ledger.runs.iter().map(|run| run.tick).collect();
    assert_eq!(ticks.len(), NORMAL_TICKS as usize + 1, "runs: {ticks:?}");
    if let Some(crash_token) = crash_token {
        // The takeover got a newer token than the crashed run.
        assert!(takeover.fencing_token > Some(crash_token));
    }
    match expected {
        // Redis: the key stayed held until the lease ran out.
        Takeover::AfterTheLease => {
            assert!(after >= LEASE * 2 / 3, "taken over after {after:?}");
            assert!(
                after <= LEASE + TICK + JOB * 2,
                "taken over after {after:?}"
            );
        }
        // In process the crash dropped the guard; with MySQL it closed the session:
        // the next tick takes over.
        Takeover::AtOnce => assert_eq!(takeover.tick, CRASH_TICK + 1),
    }
}

/// A `redis-server` of the example's own on a free port, stopped on drop.
#[cfg(feature = "redis")]
mod redis_process {
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    pub struct RedisProcess {
        pub port: u16,
        child: Child,
    }

    impl RedisProcess {
        /// `None` when `redis-server` is not installed.
        pub fn start() -> Option<RedisProcess> {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .expect("a free port")
                .port();
            let spawned = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(error) if error.kind() == ErrorKind::NotFound => return None,
                Err(error) => panic!("cannot start redis-server: {error}"),
            };
            let mut redis = RedisProcess { port, child };
            let deadline = Instant::now() + Duration::from_secs(10);
            while !redis.answers_ping() {
                if let Ok(Some(status)) = redis.child.try_wait() {
                    panic!("redis-server exited with {status}");
                }
                assert!(Instant::now() < deadline, "redis-server did not start");
                std::thread::sleep(Duration::from_millis(10));
            }
            Some(redis)
        }

        fn answers_ping(&self) -> bool {
            let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
                return false;
            };
            let mut reply = [0u8; 7];
            stream.write_all(b"PING\r\n").is_ok()
                && stream.read_exact(&mut reply).is_ok()
                && &reply == b"+PONG\r\n"
        }
    }

    impl Drop for RedisProcess {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A MariaDB server of the example's own: `mariadb-install-db` into a temp dir,
/// `mariadbd` on a free port of 127.0.0.1 (never the system's), removed on drop.
#[cfg(feature = "mysql")]
mod mysql_process {
    use std::net::TcpListener;
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    pub struct MariaDb {
        pub port: u16,
        root: PathBuf,
        child: Child,
    }

    impl MariaDb {
        /// Panics, saying what to install, when MariaDB is missing.
        pub fn start() -> MariaDb {
            let root = std::env::temp_dir().join(format!(
                "tower-keyed-lock-example-mariadb-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("tmp")).expect("a temp dir");
            let user =
                String::from_utf8(Command::new("id").arg("-un").output().unwrap().stdout).unwrap();
            let (data, tmp) = (root.join("data"), root.join("tmp"));
            let installed = Command::new("mariadb-install-db")
                .arg("--no-defaults")
                .arg(format!("--datadir={}", data.display()))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
                .arg(format!("--user={}", user.trim()))
                .arg(format!("--tmpdir={}", tmp.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            assert!(
                installed.is_ok_and(|status| status.success()),
                "mariadb-install-db failed or is missing: apt-get install mariadb-server"
            );
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .expect("a free port")
                .port();
            let socket = root.join("mariadb.sock");
            let child = Command::new("/usr/sbin/mariadbd")
                .arg("--no-defaults")
                .arg(format!("--datadir={}", data.display()))
                .arg(format!("--tmpdir={}", tmp.display()))
                .arg(format!("--socket={}", socket.display()))
                .arg(format!("--pid-file={}", root.join("mariadb.pid").display()))
                .arg(format!("--port={port}"))
                .args(["--bind-address=127.0.0.1", "--skip-log-bin"])
                .arg(format!("--user={}", user.trim()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("cannot start /usr/sbin/mariadbd: apt-get install mariadb-server");
            let mut server = MariaDb { port, root, child };
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let created = Command::new("mariadb")
                    .arg("--no-defaults")
                    .arg(format!("--socket={}", socket.display()))
                    .args(["-uroot", "-e", "CREATE DATABASE IF NOT EXISTS cron"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
                if created.is_ok_and(|status| status.success()) {
                    return server;
                }
                if let Ok(Some(status)) = server.child.try_wait() {
                    panic!("mariadbd exited with {status}");
                }
                assert!(Instant::now() < deadline, "mariadbd did not start");
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        pub fn url(&self) -> String {
            format!(
                "mysql://root@127.0.0.1:{}/cron?prefer_socket=false",
                self.port
            )
        }
    }

    impl Drop for MariaDb {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}
