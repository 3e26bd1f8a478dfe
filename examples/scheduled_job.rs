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
//! in-process lock instead. With `SCHEDULED_JOB_ENGINE=etcd` (and the `etcd` feature:
//! `cargo run --features etcd --example scheduled_job`) the instances share an `etcd`
//! of the example's own instead (a single member on free ports; a 2 s lease, since etcd
//! counts leases in whole seconds). With `SCHEDULED_JOB_ENGINE=zookeeper` (and the
//! `zookeeper` feature) they share a standalone ZooKeeper server of the example's own
//! (Debian `zookeeper`, on Java; a 200 ms tick, so a 2 s session is granted as asked):
//! the crashed instance's session expires a session timeout after the server last
//! heard of it, which frees the key. With `SCHEDULED_JOB_ENGINE=mysql` (and the `mysql`
//! feature) they share a MariaDB server the example starts on a free port with a data
//! dir of its own (`MySqlBackend`, `GET_LOCK`; it needs `mariadb-server` installed): a
//! session lock ends with its connection, once the statement the holder keeps pending
//! ends (within one liveness interval, 1 s), and a later tick takes over with a newer
//! fencing token. With `SCHEDULED_JOB_ENGINE=redlock` (the
//! `redis` feature) they share five `redis-server`s the example starts (`RedlockBackend`:
//! a majority of five masters; no fencing tokens, so the ledger orders nothing by
//! token). With `SCHEDULED_JOB_ENGINE=azure-blob`
//! (and the `azure-blob` feature) they share an Azurite (Azure Blob Storage's emulator,
//! from npm; `scripts/test` installs it) of the example's own: blob leases are 15 s at
//! least, so the takeover comes about 15 s after the crash. With
//! `SCHEDULED_JOB_ENGINE=s3` (and the `s3` feature) they share a bucket on moto's S3
//! server (from PyPI; `scripts/test` installs it) of the example's own: S3 keeps no
//! expiry, so another instance takes the crashed holder's object over once it has seen
//! it unchanged for a lease. It checks what it shows and exits non-zero otherwise: every
//! tick before the crash ran exactly once, the job's writes carry increasing fencing
//! tokens, and the takeover came within the lease.

use std::sync::{mpsc, Arc, Mutex, OnceLock};
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

/// The etcd lease: whole seconds, and etcd frees an expired lease at its next sweep
/// (every 500 ms), so a takeover may come up to that much later.
#[cfg(feature = "etcd")]
const ETCD_LEASE: Duration = Duration::from_secs(2);
#[cfg(feature = "etcd")]
const ETCD_SWEEP: Duration = Duration::from_millis(500);

/// Azure's shortest blob lease.
#[cfg(feature = "azure-blob")]
const AZURE_LEASE: Duration = Duration::from_secs(15);

// The tests' Azurite launcher and SAS signing (the Azure SDK signs no shared keys).
#[cfg(feature = "azure-blob")]
#[path = "../tests/support/azurite_server.rs"]
mod azurite_server;

// The tests' moto launcher (S3 with path-style addressing, one request at a time).
#[cfg(feature = "s3")]
#[path = "../tests/support/moto_server.rs"]
mod moto_server;

/// The bucket the instances share on moto.
#[cfg(feature = "s3")]
const S3_BUCKET: &str = "jobs";

// Ports below the kernel's ephemeral range: a readiness probe that connects again and
// again to a port of that range can connect to itself (TCP simultaneous open, as the
// probe's own source port comes round to it) and then wait for an answer it sent.
#[path = "../tests/support/ports.rs"]
mod ports;
// What those launchers run their servers with.
#[cfg(any(feature = "azure-blob", feature = "s3"))]
#[path = "../tests/support/process.rs"]
mod process;

/// Sends `request` to a server of the example's own on 127.0.0.1 and reads its answer,
/// waiting at most a second for each: `None` until it serves.
// The servers' launchers ask; without any engine feature the job runs in process only.
#[cfg_attr(
    not(any(feature = "redis", feature = "etcd", feature = "zookeeper")),
    allow(dead_code)
)]
fn ask(port: u16, request: &[u8], answer_len: Option<usize>) -> Option<String> {
    use std::io::{Read, Write};
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let limit = Duration::from_secs(1);
    let mut stream = std::net::TcpStream::connect_timeout(&address, limit).ok()?;
    stream.set_read_timeout(Some(limit)).ok()?;
    stream.set_write_timeout(Some(limit)).ok()?;
    stream.write_all(request).ok()?;
    let mut answer = Vec::new();
    match answer_len {
        Some(len) => {
            answer.resize(len, 0);
            stream.read_exact(&mut answer).ok()?;
        }
        None => {
            stream.read_to_end(&mut answer).ok()?;
        }
    }
    String::from_utf8(answer).ok()
}

/// The ZooKeeper session timeout, and the server's tick: it expires sessions in
/// buckets of a tick, so a takeover may come up to that much later.
#[cfg(feature = "zookeeper")]
const ZOOKEEPER_SESSION: Duration = Duration::from_secs(2);
#[cfg(feature = "zookeeper")]
const ZOOKEEPER_TICK: Duration = Duration::from_millis(200);

/// How the instances reach each other.
enum Shared {
    #[cfg(feature = "redis")]
    Redis(String),
    #[cfg(feature = "redis")]
    Redlock(Vec<String>),
    #[cfg(feature = "etcd")]
    Etcd(String),
    #[cfg(feature = "mysql")]
    MySql(String),
    #[cfg(feature = "azure-blob")]
    AzureBlob(String),
    #[cfg(feature = "s3")]
    S3(String),
    #[cfg(feature = "zookeeper")]
    ZooKeeper(String),
    InProcess(DistributedLocks),
}

impl Shared {
    /// The longest a crashed holder keeps the key: its lease, and the engine's delay in
    /// freeing it.
    fn loss_bound(&self) -> Duration {
        match self {
            #[cfg(feature = "etcd")]
            Shared::Etcd(_) => ETCD_LEASE + ETCD_SWEEP,
            #[cfg(feature = "azure-blob")]
            Shared::AzureBlob(_) => AZURE_LEASE,
            #[cfg(feature = "zookeeper")]
            Shared::ZooKeeper(_) => ZOOKEEPER_SESSION + ZOOKEEPER_TICK,
            #[cfg(feature = "mysql")]
            Shared::MySql(_) => tower_keyed_lock::backend::mysql::DEFAULT_LIVENESS_INTERVAL,
            _ => LEASE,
        }
    }

    /// The last tick fired while waiting for the takeover: past the loss bound.
    fn last_tick(&self) -> u64 {
        match self {
            #[cfg(feature = "azure-blob")]
            Shared::AzureBlob(_) => CRASH_TICK + AZURE_LEASE.as_secs() + 3,
            _ => LAST_TICK,
        }
    }

    /// Whether a crashed holder's key comes back with its process: the in-process
    /// lock ends with it; a lease runs out, MySQL's pending statement ends.
    fn takes_over_at_once(&self) -> bool {
        matches!(self, Shared::InProcess(_))
    }

    /// The shortest a crashed holder keeps the key.
    fn lease(&self) -> Duration {
        match self {
            #[cfg(feature = "etcd")]
            Shared::Etcd(_) => ETCD_LEASE,
            #[cfg(feature = "azure-blob")]
            Shared::AzureBlob(_) => AZURE_LEASE,
            #[cfg(feature = "zookeeper")]
            Shared::ZooKeeper(_) => ZOOKEEPER_SESSION,
            // No lease: the key comes back when the holder's pending statement ends.
            #[cfg(feature = "mysql")]
            Shared::MySql(_) => Duration::ZERO,
            _ => LEASE,
        }
    }

    /// The instance's locks. A backend that cannot reach its server yet (one that just
    /// started, on a loaded machine) is built again for up to 30 s, as a service's
    /// start-up would retry.
    async fn locks(&self) -> DistributedLocks {
        let started = Instant::now();
        loop {
            match self.try_locks().await {
                Ok(locks) => return locks,
                Err(error) if started.elapsed() < Duration::from_secs(30) => {
                    eprintln!(
                        "the instance cannot reach its lock server yet ({error}); trying again"
                    );
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(error) => panic!("the instance cannot reach its lock server: {error}"),
            }
        }
    }

    async fn try_locks(&self) -> Result<DistributedLocks, String> {
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
                    .map_err(|error| format!("connects to Redis: {error:?}"))?;
                Ok(DistributedLocks::new("cron", backend))
            }
            #[cfg(feature = "redis")]
            Shared::Redlock(masters) => {
                let backend = tower_keyed_lock::RedlockBackend::builder(masters.clone())
                    .lease(LEASE)
                    // Masters the example just started, as for Redis above.
                    .restart_guard(false)
                    .build()
                    .await
                    .map_err(|error| format!("reaches a majority of the masters: {error:?}"))?;
                Ok(DistributedLocks::new("cron", backend))
            }
            #[cfg(feature = "etcd")]
            Shared::Etcd(endpoint) => {
                let backend = tower_keyed_lock::EtcdBackend::builder([endpoint.as_str()])
                    .lease(ETCD_LEASE)
                    .build()
                    .await
                    .map_err(|error| format!("connects to etcd: {error:?}"))?;
                Ok(DistributedLocks::new("cron", backend))
            }
            #[cfg(feature = "mysql")]
            Shared::MySql(url) => {
                let backend = tower_keyed_lock::MySqlBackend::builder_from_url(url)
                    .expect("a valid MySQL URL")
                    .fencing(true)
                    .build_lazy();
                Ok(DistributedLocks::new("cron", backend))
            }
            #[cfg(feature = "azure-blob")]
            Shared::AzureBlob(url) => {
                let backend = tower_keyed_lock::AzureBlobBackend::builder(url.as_str())
                    .lease(AZURE_LEASE)
                    .build()
                    .await
                    .map_err(|error| format!("reaches Azurite: {error:?}"))?;
                Ok(DistributedLocks::new("cron", backend))
            }
            #[cfg(feature = "s3")]
            Shared::S3(url) => {
                let client = moto_server::s3_client_for(url);
                // The first instance makes the bucket; the others find it made.
                if let Err(error) = client.create_bucket().bucket(S3_BUCKET).send().await {
                    let code = aws_sdk_s3::error::ProvideErrorMetadata::code(&error);
                    if !matches!(
                        code,
                        Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists")
                    ) {
                        return Err(format!("makes the bucket: {error:?}"));
                    }
                }
                let backend = tower_keyed_lock::S3Backend::builder(client, S3_BUCKET)
                    .lease(LEASE)
                    .build()
                    .await
                    .map_err(|error| format!("reaches moto's S3: {error:?}"))?;
                Ok(DistributedLocks::new("cron", backend))
            }
            #[cfg(feature = "zookeeper")]
            Shared::ZooKeeper(servers) => {
                let backend = tower_keyed_lock::ZooKeeperBackend::builder(servers.as_str())
                    .lease(ZOOKEEPER_SESSION)
                    .build()
                    .await
                    .map_err(|error| format!("connects to ZooKeeper: {error:?}"))?;
                Ok(DistributedLocks::new("cron", backend))
            }
            Shared::InProcess(locks) => Ok(locks.clone()),
        }
    }
}

fn main() {
    let engine = std::env::var("SCHEDULED_JOB_ENGINE").unwrap_or_else(|_| "redis".to_owned());
    #[cfg(feature = "etcd")]
    let etcd = (engine == "etcd")
        .then(etcd_process::EtcdProcess::start)
        .flatten();
    #[cfg(feature = "mysql")]
    let mysql = (engine == "mysql").then(mysql_process::MariaDb::start);
    #[cfg(feature = "azure-blob")]
    let azurite = (engine == "azure-blob").then(azurite_server::AzuriteServer::start);
    #[cfg(feature = "s3")]
    let moto = (engine == "s3").then(moto_server::MotoServer::start);
    #[cfg(feature = "zookeeper")]
    let zookeeper = (engine == "zookeeper")
        .then(zookeeper_process::ZooKeeperProcess::start)
        .flatten();
    #[cfg(feature = "redis")]
    let redis = (engine == "redis")
        .then(redis_process::RedisProcess::start)
        .flatten();
    #[cfg(feature = "redis")]
    let masters: Option<Vec<_>> = (engine == "redlock")
        .then(|| {
            (0..5)
                .map(|_| redis_process::RedisProcess::start())
                .collect()
        })
        .flatten();
    let shared = match engine.as_str() {
        #[cfg(feature = "redis")]
        "redis" => match &redis {
            Some(redis) => {
                println!("redis-server started on port {}", redis.port);
                Shared::Redis(format!("redis://127.0.0.1:{}/", redis.port))
            }
            None => in_process("redis-server is not installed"),
        },
        #[cfg(feature = "redis")]
        "redlock" => match &masters {
            Some(masters) => {
                let ports: Vec<u16> = masters.iter().map(|redis| redis.port).collect();
                println!("five redis-servers (Redlock masters) started on ports {ports:?}");
                let urls = ports
                    .iter()
                    .map(|port| format!("redis://127.0.0.1:{port}/"));
                Shared::Redlock(urls.collect())
            }
            None => in_process("redis-server is not installed"),
        },
        #[cfg(feature = "etcd")]
        "etcd" => match &etcd {
            Some(etcd) => {
                println!("etcd started on port {}", etcd.port);
                Shared::Etcd(format!("http://127.0.0.1:{}", etcd.port))
            }
            None => in_process("etcd is not installed"),
        },
        #[cfg(feature = "zookeeper")]
        "zookeeper" => match &zookeeper {
            Some(zookeeper) => {
                println!("ZooKeeper started on port {}", zookeeper.port);
                Shared::ZooKeeper(format!("127.0.0.1:{}", zookeeper.port))
            }
            None => in_process("ZooKeeper (or Java) is not installed"),
        },
        #[cfg(feature = "mysql")]
        "mysql" => {
            let server = mysql.as_ref().expect("started above");
            println!("mariadbd started on port {}", server.port);
            Shared::MySql(server.url())
        }
        #[cfg(feature = "azure-blob")]
        "azure-blob" => {
            let server = azurite.as_ref().expect("started above");
            println!("azurite-blob started on port {}", server.port());
            Shared::AzureBlob(server.container_url("jobs"))
        }
        #[cfg(feature = "s3")]
        "s3" => {
            let server = moto.as_ref().expect("started above");
            println!("moto (S3) started on port {}", server.port());
            Shared::S3(server.url())
        }
        #[cfg(not(feature = "redis"))]
        "redis" | "redlock" => in_process("built without the `redis` feature"),
        #[cfg(not(feature = "etcd"))]
        "etcd" => in_process("built without the `etcd` feature"),
        #[cfg(not(feature = "mysql"))]
        "mysql" => in_process("built without the `mysql` feature"),
        #[cfg(not(feature = "azure-blob"))]
        "azure-blob" => in_process("built without the `azure-blob` feature"),
        #[cfg(not(feature = "zookeeper"))]
        "zookeeper" => in_process("built without the `zookeeper` feature"),
        #[cfg(not(feature = "s3"))]
        "s3" => in_process("built without the `s3` feature"),
        other => panic!(
            "SCHEDULED_JOB_ENGINE={other:?}: use redis, redlock, etcd, zookeeper, mysql, azure-blob or s3"
        ),
    };
    let shared = Arc::new(shared);

    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let start = Arc::new(Start {
        connected: tokio::sync::Barrier::new(3),
        at: OnceLock::new(),
    });
    let instances: Vec<_> = (1..=3)
        .map(|id| {
            let (shared, ledger, start) = (shared.clone(), ledger.clone(), start.clone());
            thread::spawn(move || run_instance(id, shared, ledger, start))
        })
        .collect();
    for instance in instances {
        instance.join().expect("an instance panicked");
    }

    check(&ledger.lock().unwrap(), &shared);
    println!("ok: every tick ran once, and the crashed job was taken over");
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
/// The schedule's first tick: once every instance has connected, as a deployment's
/// instances would all be running when the schedule matters.
struct Start {
    connected: tokio::sync::Barrier,
    at: OnceLock<Instant>,
}

fn run_instance(id: usize, shared: Arc<Shared>, ledger: Arc<Mutex<Ledger>>, start: Arc<Start>) {
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
    start: Arc<Start>,
    crash: mpsc::Sender<()>,
) {
    let locks = shared.locks().await;
    start.connected.wait().await;
    let start = *start
        .at
        .get_or_init(|| Instant::now() + Duration::from_millis(200));
    for tick in 1..=shared.last_tick() {
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
fn check(ledger: &Ledger, shared: &Shared) {
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
    if shared.takes_over_at_once() {
        // In process the crash dropped the guard: the next tick takes over.
        assert_eq!(takeover.tick, CRASH_TICK + 1);
    } else {
        // A lease (Redis, etcd, Azure Blob, S3, a ZooKeeper session) or MySQL's pending
        // statement: the key stayed held until it ran out.
        let (lease, loss_bound) = (shared.lease(), shared.loss_bound());
        assert!(after >= lease * 2 / 3, "taken over after {after:?}");
        assert!(
            after <= loss_bound + TICK + JOB * 2,
            "taken over after {after:?}"
        );
    }
}

/// A `redis-server` of the example's own on a free port, stopped on drop.
#[cfg(feature = "redis")]
mod redis_process {
    use std::io::ErrorKind;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    pub struct RedisProcess {
        pub port: u16,
        child: Child,
    }

    impl RedisProcess {
        /// `None` when `redis-server` is not installed.
        pub fn start() -> Option<RedisProcess> {
            let port = super::ports::free_port();
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
            super::ask(self.port, b"PING\r\n", Some(7)).is_some_and(|reply| reply == "+PONG\r\n")
        }
    }

    impl Drop for RedisProcess {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An `etcd` of the example's own (one member) on free ports, stopped on drop.
#[cfg(feature = "etcd")]
mod etcd_process {
    use std::io::ErrorKind;
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use super::ports::free_port;

    pub struct EtcdProcess {
        pub port: u16,
        child: Child,
        dir: PathBuf,
    }

    impl EtcdProcess {
        /// `None` when `etcd` is not installed.
        pub fn start() -> Option<EtcdProcess> {
            let (port, peer) = (free_port(), free_port());
            let dir = std::env::temp_dir().join(format!(
                "tower-keyed-lock-example-etcd-{}-{port}",
                std::process::id()
            ));
            let client = format!("http://127.0.0.1:{port}");
            let peer = format!("http://127.0.0.1:{peer}");
            let spawned = Command::new("etcd")
                .args(["--name", "example", "--log-level", "error"])
                .arg("--data-dir")
                .arg(&dir)
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--listen-peer-urls", &peer])
                .args(["--initial-advertise-peer-urls", &peer])
                .args(["--initial-cluster", &format!("example={peer}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let child = match spawned {
                Ok(child) => child,
                Err(error) if error.kind() == ErrorKind::NotFound => return None,
                Err(error) => panic!("cannot start etcd: {error}"),
            };
            let mut etcd = EtcdProcess { port, child, dir };
            let deadline = Instant::now() + Duration::from_secs(20);
            while !etcd.is_healthy() {
                if let Ok(Some(status)) = etcd.child.try_wait() {
                    panic!("etcd exited with {status}");
                }
                assert!(Instant::now() < deadline, "etcd did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
            Some(etcd)
        }

        /// `GET /health` answers `"health":"true"` once the member has a leader.
        fn is_healthy(&self) -> bool {
            let request = format!(
                "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
                self.port
            );
            super::ask(self.port, request.as_bytes(), None)
                .is_some_and(|reply| reply.contains("\"health\":\"true\""))
        }
    }

    impl Drop for EtcdProcess {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A standalone ZooKeeper server of the example's own on a free port (the Debian
/// package's jar on the installed Java), stopped on drop.
#[cfg(feature = "zookeeper")]
mod zookeeper_process {
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    const JAR: &str = "/usr/share/java/zookeeper.jar";

    pub struct ZooKeeperProcess {
        pub port: u16,
        child: Child,
        dir: PathBuf,
    }

    impl ZooKeeperProcess {
        /// `None` when ZooKeeper's jar or Java is not installed.
        pub fn start() -> Option<ZooKeeperProcess> {
            let jar = std::env::var("ZOOKEEPER_JAR").unwrap_or_else(|_| JAR.to_owned());
            if !Path::new(&jar).is_file() {
                return None;
            }
            let port = super::ports::free_port();
            let dir = std::env::temp_dir().join(format!(
                "tower-keyed-lock-example-zookeeper-{}-{port}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).expect("a data dir");
            let config = dir.join("zoo.cfg");
            std::fs::write(
                &config,
                format!(
                    "tickTime={}\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                     admin.enableServer=false\n4lw.commands.whitelist=ruok\n",
                    super::ZOOKEEPER_TICK.as_millis(),
                    dir.display()
                ),
            )
            .expect("writing zoo.cfg");
            let spawned = Command::new("java")
                .args(["-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"])
                .args([
                    "-cp",
                    &jar,
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                ])
                .arg(&config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let Ok(child) = spawned else {
                return None; // no Java
            };
            let mut server = ZooKeeperProcess { port, child, dir };
            let deadline = Instant::now() + Duration::from_secs(30);
            while !server.is_ok() {
                if let Ok(Some(status)) = server.child.try_wait() {
                    panic!("ZooKeeper exited with {status}");
                }
                assert!(Instant::now() < deadline, "ZooKeeper did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
            Some(server)
        }

        /// `ruok` answers `imok` once the server runs.
        fn is_ok(&self) -> bool {
            super::ask(self.port, b"ruok", None).is_some_and(|reply| reply == "imok")
        }
    }

    impl Drop for ZooKeeperProcess {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// A MariaDB server of the example's own: `mariadb-install-db` into a temp dir,
/// `mariadbd` on a free port of 127.0.0.1 (never the system's), removed on drop.
#[cfg(feature = "mysql")]
mod mysql_process {
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
            let port = super::ports::free_port();
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
