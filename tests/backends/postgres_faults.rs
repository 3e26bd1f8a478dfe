//! The PostgreSQL backend under network faults: an instance reaches a real PostgreSQL
//! through `support/tcp_proxy.rs`, which goes silent (blackhole), slows down (delay) or
//! resets its connections, while another instance connects directly. Each test prints
//! the figures it measures (`--nocapture`); `PG_FAULT_TRIALS` sets how many trials the
//! timing tests run (default 3).
#![cfg(feature = "postgres")]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls};
use tower_keyed_lock::backend::postgres::{PostgresBackend, PostgresBackendBuilder};
use tower_keyed_lock::backend::LostReason;
use tower_keyed_lock::{Key, Lease, LockBackend, LockError};

use crate::support::pg_server::PgServer;
use crate::support::tcp_proxy::TcpProxy;

/// Long enough for anything that should happen; a test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(10);
const LIVENESS: Duration = Duration::from_millis(100);
const NETWORK: Duration = Duration::from_millis(300);
/// How long the server lets a holding session sit idle: one liveness interval plus two
/// network timeouts (see the module docs).
const SERVER_LIMIT: Duration = Duration::from_millis(100 + 2 * 300);
/// Scheduling slack on a busy 2-core machine.
const SLACK: Duration = Duration::from_millis(250);

pub(crate) fn trials() -> usize {
    std::env::var("PG_FAULT_TRIALS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3)
}

pub(crate) fn pg_addr(pg: &PgServer) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], pg.port()))
}

/// An instance whose connections go to `host_port` (the proxy or the server).
pub(crate) fn builder(host_port: &str, instance: &str) -> PostgresBackendBuilder {
    let (host, port) = host_port.split_once(':').unwrap();
    let mut config = tokio_postgres::Config::new();
    config
        .host(host)
        .port(port.parse().unwrap())
        .user("postgres")
        .dbname("postgres")
        .application_name(instance);
    // A holding session's application name is its holder record, which ends with
    // the instance id: `instance` still finds it (`tkl % <instance>`).
    PostgresBackend::builder_from_config(config)
        .instance_id(instance)
        .liveness_interval(LIVENESS)
        .command_timeout(NETWORK)
        .fencing(true)
}

/// [`builder`] as it is, connecting on first use.
fn backend(host_port: &str, instance: &str) -> PostgresBackend {
    builder(host_port, instance).build_lazy()
}

fn direct_builder(pg: &PgServer, instance: &str) -> PostgresBackendBuilder {
    builder(&format!("127.0.0.1:{}", pg.port()), instance)
}

fn direct(pg: &PgServer, instance: &str) -> PostgresBackend {
    direct_builder(pg, instance).build_lazy()
}

fn key(key: &str) -> Key {
    Key::new(key, 64).unwrap()
}

pub(crate) async fn admin(pg: &PgServer) -> Client {
    let (client, connection) = tokio_postgres::connect(&pg.conn_str(), NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

async fn eventually<F: Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    let deadline = Instant::now() + PATIENCE;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether a session of `instance` waits on an advisory lock now.
pub(crate) async fn waits_in_postgres(admin: &Client, instance: &str) -> bool {
    let waiting: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
             AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            &[&instance],
        )
        .await
        .unwrap()
        .get(0);
    waiting > 0
}

/// Acquires `key` on `backend` in a task of its own, with a long wait; the lease and
/// when it was granted.
fn spawn_waiter(
    backend: &PostgresBackend,
    key_name: &str,
) -> tokio::task::JoinHandle<(Lease, Instant)> {
    let acquiring = backend.acquire("orders", &key(key_name), PATIENCE);
    tokio::spawn(async move {
        let lease = acquiring.await.expect("the waiter is granted");
        (lease, Instant::now())
    })
}

/// When `lease` is told it is lost.
fn spawn_lost_watch(lease: &Lease) -> tokio::task::JoinHandle<Instant> {
    let signal = lease.signal().clone();
    tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    })
}

pub(crate) fn ms(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1e3)
}

/// A figure from several trials: min / median / max.
pub(crate) fn spread(mut figures: Vec<Duration>) -> String {
    figures.sort();
    format!(
        "min {} / median {} / max {} ({} trials)",
        ms(figures[0]),
        ms(figures[figures.len() / 2]),
        ms(figures[figures.len() - 1]),
        figures.len()
    )
}

// ---------------------------------------------------------------- partitions

/// The path to the holder goes silent (nothing arrives, nothing is closed — not even the
/// holder's own close): the holder is told its lease is lost, and PostgreSQL, which
/// hears nothing, ends the idle holding session at its limit, so another instance gets
/// the key — before the limit was set on every holding session, it stayed held until
/// TCP keepalive gave up (hours by default). The holder is told first: it stops
/// hearing answers a network timeout before the server's limit runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitioned_holder_is_told_first_and_the_key_is_freed_in_bounded_time() {
    let pg = PgServer::start();
    let (mut freed, mut margins) = (Vec::new(), Vec::new());
    for trial in 0..trials() {
        let proxy = TcpProxy::start(pg_addr(&pg)).await;
        let holder = backend(&proxy.host_port(), "partitioned");
        let other = direct(&pg, "other");
        let name = format!("partition-{trial}");
        let lease = holder
            .acquire("orders", &key(&name), Duration::ZERO)
            .await
            .unwrap();
        let lost = spawn_lost_watch(&lease);
        // Vary where in the liveness period the partition begins.
        tokio::time::sleep(Duration::from_millis(37 * trial as u64 % 100)).await;

        proxy.blackhole();
        let cut = Instant::now();
        let waiter = spawn_waiter(&other, &name);
        let (granted, granted_at) = tokio::time::timeout(PATIENCE, waiter)
            .await
            .expect("the key was never freed")
            .unwrap();
        let lost_at = tokio::time::timeout(PATIENCE, lost)
            .await
            .expect("the holder was never told")
            .unwrap();
        assert!(
            granted_at.duration_since(cut) < SERVER_LIMIT + LIVENESS + NETWORK + SLACK,
            "freed {} after the partition",
            ms(granted_at.duration_since(cut))
        );
        assert!(
            lost_at < granted_at,
            "the other instance was granted {} before the holder was told",
            ms(lost_at.duration_since(granted_at))
        );
        freed.push(granted_at.duration_since(cut));
        margins.push(granted_at.duration_since(lost_at));
        granted.release().await;
        drop(lease);
    }
    println!("partition: key free again after {}", spread(freed));
    println!(
        "partition: holder told before the other grant by {}",
        spread(margins)
    );
}

/// `pg_terminate_backend` on the holding session: PostgreSQL frees the lock at once and
/// a waiting instance is granted within milliseconds. The holder is told as soon as its
/// connection closes, not at its next liveness check (here 5 s away): before, the
/// window in which both ran was up to a whole liveness interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn terminated_holder_is_told_as_soon_as_its_connection_closes() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let (mut windows, mut told) = (Vec::new(), Vec::new());
    for trial in 0..trials() {
        let holder = direct_builder(&pg, "terminated")
            .liveness_interval(Duration::from_secs(5))
            .build_lazy();
        let other = direct(&pg, "waiting");
        let name = format!("terminate-{trial}");
        let lease = holder
            .acquire("orders", &key(&name), Duration::ZERO)
            .await
            .unwrap();
        let lost = spawn_lost_watch(&lease);
        let waiter = spawn_waiter(&other, &name);
        eventually("the other instance waits in PostgreSQL", || {
            waits_in_postgres(&admin, "waiting")
        })
        .await;

        let terminated = Instant::now();
        admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name = 'terminated' \
                 OR application_name LIKE 'tkl % terminated'",
                &[],
            )
            .await
            .unwrap();
        let (granted, granted_at) = tokio::time::timeout(PATIENCE, waiter)
            .await
            .expect("never granted")
            .unwrap();
        let lost_at = tokio::time::timeout(PATIENCE, lost)
            .await
            .expect("the holder was never told")
            .unwrap();
        assert!(
            lost_at.duration_since(terminated) < Duration::from_millis(100) + SLACK,
            "told {} after its session was terminated",
            ms(lost_at.duration_since(terminated))
        );
        told.push(lost_at.duration_since(terminated));
        // Positive: both ran, the holder not yet told; the fencing token orders them.
        windows.push(lost_at.saturating_duration_since(granted_at));
        assert!(granted.fencing_token() > lease.fencing_token());
        granted.release().await;
    }
    println!(
        "terminate: holder told {} after the termination",
        spread(told)
    );
    println!(
        "terminate: other instance granted before the holder was told by {}",
        spread(windows)
    );
}

// ---------------------------------------------------------------- no hang

/// While the path is silent, every acquisition through it ends within its wait plus
/// one network timeout — on a pooled connection, on a new one, or waiting in
/// PostgreSQL's queue — and after the path heals the same instance serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_path_never_hangs_an_acquisition_and_heals() {
    let pg = PgServer::start();
    let proxy = TcpProxy::start(pg_addr(&pg)).await;
    let cut_off = builder(&proxy.host_port(), "cut-off")
        .max_connections(3)
        .build_lazy();
    let other = direct(&pg, "other");
    // Two pooled connections through the proxy.
    let warm = [
        cut_off
            .acquire("orders", &key("warm-1"), Duration::ZERO)
            .await
            .unwrap(),
        cut_off
            .acquire("orders", &key("warm-2"), Duration::ZERO)
            .await
            .unwrap(),
    ];
    for lease in warm {
        lease.release().await;
    }
    let held = other
        .acquire("orders", &key("busy"), Duration::ZERO)
        .await
        .unwrap();

    let admin = admin(&pg).await;
    let wait = Duration::from_millis(800);
    let started = Instant::now();
    let waiting = tokio::spawn(cut_off.acquire("orders", &key("busy"), wait));
    eventually("the cut-off instance waits in PostgreSQL", || {
        waits_in_postgres(&admin, "cut-off")
    })
    .await;

    proxy.blackhole();
    let result = waiting.await.unwrap();
    let took = started.elapsed();
    assert!(result.is_err(), "granted through a silent path: {result:?}");
    assert!(
        took < wait + NETWORK + SLACK,
        "the waiter answered after {}",
        ms(took)
    );
    println!(
        "blackhole: waiter in PostgreSQL answered after {} (wait {})",
        ms(took),
        ms(wait)
    );
    // The pooled connection, then a new one (the pooled one was closed).
    for attempt in ["pooled connection", "new connection"] {
        let started = Instant::now();
        let result = cut_off.acquire("orders", &key("free"), wait).await;
        let took = started.elapsed();
        assert!(result.is_err(), "granted through a silent path: {result:?}");
        assert!(
            took < wait + NETWORK + SLACK,
            "{attempt}: answered after {}",
            ms(took)
        );
        println!("blackhole: {attempt} answered after {}", ms(took));
    }

    proxy.heal();
    held.release().await;
    let healed = Instant::now();
    loop {
        match cut_off.acquire("orders", &key("busy"), wait).await {
            Ok(lease) => {
                lease.release().await;
                break;
            }
            Err(error) => assert!(
                healed.elapsed() < PATIENCE,
                "still failing after the path healed: {error}"
            ),
        }
    }
    println!(
        "blackhole: serving again {} after the heal",
        ms(healed.elapsed())
    );
}

// ---------------------------------------------------------------- delay, reset

/// A slow path below the network timeout costs nothing: the holder keeps its lease
/// through many liveness checks and the other instance gets the key only after the
/// release (three tries: on a loaded machine the checks may go unanswered all the
/// same, and the holder must then be told before the other grant). Slower than the
/// network timeout, the holder is told, closes its connection, and the other instance
/// is granted after it was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delayed_path_keeps_the_lease_until_it_exceeds_the_command_timeout() {
    let pg = PgServer::start();
    let admin = admin(&pg).await;
    let proxy = TcpProxy::start(pg_addr(&pg)).await;
    let slow = backend(&proxy.host_port(), "slow");
    let other = direct(&pg, "other");
    let kept = async {
        for attempt in 1..=3 {
            if slow_holder_keeps(&proxy, &slow, &other, &format!("slow-{attempt}")).await {
                return true;
            }
            println!(
                "attempt {attempt}: the slow holder's checks went unanswered all the same \
                 (a loaded machine), and it was told before the other grant; again"
            );
        }
        false
    };
    assert!(
        kept.await,
        "in 3 attempts a slow but live holder never kept its lease"
    );

    let lease = slow
        .acquire("orders", &key("1"), Duration::from_secs(2))
        .await
        .unwrap();
    let lost = spawn_lost_watch(&lease);
    let waiter = spawn_waiter(&other, "1");
    eventually("the other instance waits in PostgreSQL", || {
        waits_in_postgres(&admin, "other")
    })
    .await;
    proxy.delay(NETWORK * 2);
    let (granted, granted_at) = tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("never granted")
        .unwrap();
    let lost_at = lost.await.unwrap();
    assert!(
        lost_at < granted_at,
        "granted {} before the slow holder was told",
        ms(lost_at.duration_since(granted_at))
    );
    println!(
        "delay {}: holder told before the other grant by {}",
        ms(NETWORK * 2),
        ms(granted_at.duration_since(lost_at))
    );
    granted.release().await;
}

/// One try of a holder on a path slower than usual (60 ms each way) but within the
/// network timeout:
/// `true` when it kept `key_name` through 15 liveness checks and the other instance was
/// granted only after the release; `false` when its checks went unanswered all the same
/// (a loaded machine) and it was told so before the other instance was granted.
async fn slow_holder_keeps(
    proxy: &TcpProxy,
    slow: &PostgresBackend,
    other: &PostgresBackend,
    key_name: &str,
) -> bool {
    // The slow path is the subject, not a connect over it: a connection made over it
    // takes more round trips than the command timeout allows (and after a lost try the
    // holder's connection is gone), so the key is taken at full speed.
    proxy.delay(Duration::ZERO);
    let lease = slow
        .acquire("orders", &key(key_name), Duration::from_secs(2))
        .await
        .unwrap();
    proxy.delay(Duration::from_millis(60));
    let lost = spawn_lost_watch(&lease);
    let waiter = spawn_waiter(other, key_name);
    tokio::time::sleep(LIVENESS * 15).await;
    if let Some(reason) = lease.signal().lost_reason() {
        // Its checks went unanswered, or the deadline came while one was on its way.
        assert!(
            matches!(reason, LostReason::Unreachable | LostReason::Expired),
            "a slow but live holder lost its lease ({reason:?})"
        );
        let lost_at = lost.await.unwrap();
        let (granted, granted_at) = tokio::time::timeout(PATIENCE, waiter)
            .await
            .expect("never granted")
            .unwrap();
        assert!(
            lost_at < granted_at,
            "granted before the slow holder was told"
        );
        granted.release().await;
        return false;
    }
    assert!(
        !waiter.is_finished(),
        "granted while the slow holder held the key"
    );
    let released = Instant::now();
    lease.release().await;
    let (granted, granted_at) = waiter.await.unwrap();
    assert!(granted_at > released);
    granted.release().await;
    true
}

/// Connections reset under the holder: it is told at once, and the same instance
/// takes keys again on new connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reset_connection_is_noticed_at_once_and_recovers() {
    let pg = PgServer::start();
    let proxy = TcpProxy::start(pg_addr(&pg)).await;
    let holder = backend(&proxy.host_port(), "reset");
    let other = direct(&pg, "other");
    let mut told = Vec::new();
    for trial in 0..trials() {
        let name = format!("reset-{trial}");
        let lease = holder
            .acquire("orders", &key(&name), Duration::ZERO)
            .await
            .unwrap();
        let lost = spawn_lost_watch(&lease);
        let reset = Instant::now();
        proxy.reset();
        let lost_at = tokio::time::timeout(PATIENCE, lost)
            .await
            .expect("never told")
            .unwrap();
        told.push(lost_at.duration_since(reset));
        assert!(lost_at.duration_since(reset) < Duration::from_millis(50) + SLACK);
        let taken = other
            .acquire("orders", &key(&name), Duration::from_secs(2))
            .await
            .expect("freed by the reset");
        assert!(taken.fencing_token() > lease.fencing_token());
        taken.release().await;
        // The same instance, no restart: new connections through the proxy.
        holder
            .acquire("orders", &key(&name), Duration::from_secs(2))
            .await
            .expect("serving again after the reset")
            .release()
            .await;
    }
    println!("reset: holder told {} after the reset", spread(told));
}

/// The error a silent path gives is a backend error (503), not a wait timeout (409).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_path_is_a_backend_error() {
    let pg = PgServer::start();
    let proxy = TcpProxy::start(pg_addr(&pg)).await;
    let cut_off = backend(&proxy.host_port(), "cut-off");
    proxy.blackhole();
    let result = cut_off
        .acquire("orders", &key("1"), Duration::from_millis(200))
        .await;
    assert!(matches!(result, Err(LockError::Backend(_))), "{result:?}");
}

/// Only the wait bounds the waiting: a waiter whose connection is reset while it waits
/// in PostgreSQL's queue, and whose path then stays silent, queues again and again
/// until its wait ends; it fails then, not before, with a backend error (503: nothing
/// answered since the reset), not a wait timeout (409).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broken_path_ends_a_wait_only_at_its_deadline() {
    let pg = PgServer::start();
    let proxy = TcpProxy::start(pg_addr(&pg)).await;
    let cut_off = backend(&proxy.host_port(), "cut-off");
    let held = direct(&pg, "other")
        .acquire("orders", &key("busy"), Duration::ZERO)
        .await
        .unwrap();
    let admin = admin(&pg).await;
    let wait = Duration::from_millis(1500);
    let mut took = Vec::new();
    for _ in 0..trials() {
        let started = Instant::now();
        let waiting = tokio::spawn(cut_off.acquire("orders", &key("busy"), wait));
        eventually("the cut-off instance waits in PostgreSQL", || {
            waits_in_postgres(&admin, "cut-off")
        })
        .await;
        proxy.reset();
        proxy.blackhole();
        let result = waiting.await.unwrap();
        let elapsed = started.elapsed();
        assert!(
            matches!(result, Err(LockError::Backend(_))),
            "after {}: {result:?}",
            ms(elapsed)
        );
        assert!(
            elapsed >= wait,
            "the wait ended early: after {}",
            ms(elapsed)
        );
        assert!(
            elapsed < wait + NETWORK + SLACK,
            "the waiter answered after {}",
            ms(elapsed)
        );
        took.push(elapsed);
        proxy.heal();
        eventually("the waiter's sessions are gone", || async {
            !waits_in_postgres(&admin, "cut-off").await
        })
        .await;
    }
    held.release().await;
    println!(
        "broken path: the {} wait ended after {}",
        ms(wait),
        spread(took)
    );
}

// ---------------------------------------------------------------- mixed faults

/// What the handlers of the mixed-fault run saw.
#[derive(Default, Debug)]
struct Tally {
    granted_cut_off: u64,
    granted_direct: u64,
    refused: u64,
    lost: u64,
    /// A grant while another holder of the key had not been told it lost its lease.
    unsignalled_overlaps: u64,
    /// A token not above the previous holder's.
    token_regressions: u64,
}

/// The holders of one key now, and the last token granted for it.
#[derive(Default)]
struct KeyState {
    holders: Vec<(u64, tower_keyed_lock::LeaseSignal)>,
    last_token: u64,
}

/// Holds `lease` for `hold` as a handler would: counts a grant while another holder of
/// the key has not been told it lost it, and a token not above the key's last.
async fn hold_checked(
    state: &Mutex<KeyState>,
    tally: &Mutex<Tally>,
    lease: Lease,
    through_proxy: bool,
    hold: Duration,
) {
    let token = lease.fencing_token().unwrap();
    {
        let mut state = state.lock().unwrap();
        let mut tally = tally.lock().unwrap();
        if state.holders.iter().any(|(_, signal)| !signal.is_lost()) {
            tally.unsignalled_overlaps += 1;
        }
        if token <= state.last_token {
            tally.token_regressions += 1;
        }
        state.last_token = token;
        state.holders.push((token, lease.signal().clone()));
        match through_proxy {
            true => tally.granted_cut_off += 1,
            false => tally.granted_direct += 1,
        }
    }
    tokio::time::sleep(hold).await;
    state
        .lock()
        .unwrap()
        .holders
        .retain(|(held, _)| *held != token);
    if lease.signal().is_lost() {
        tally.lock().unwrap().lost += 1;
    }
    lease.release().await;
}

/// Two instances, one behind the proxy, hammer four keys while the proxy goes silent
/// and slow (past the network timeout) in turn: a key is never granted while another
/// holder has not been told it lost it, fencing tokens never go back, and both
/// instances serve again once the path is healthy. `PG_FAULT_SECONDS` sets the length
/// (default 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_and_slow_paths_never_grant_a_key_twice() {
    let seconds: u64 = std::env::var("PG_FAULT_SECONDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(8);
    let pg = PgServer::start();
    let proxy = Arc::new(TcpProxy::start(pg_addr(&pg)).await);
    let cut_off = backend(&proxy.host_port(), "cut-off");
    let other = direct(&pg, "other");
    let keys: Arc<Vec<Mutex<KeyState>>> = Arc::new((0..4).map(|_| Mutex::default()).collect());
    let tally = Arc::new(Mutex::new(Tally::default()));
    let until = Instant::now() + Duration::from_secs(seconds);

    let mut tasks = Vec::new();
    for task in 0..12u64 {
        let (through_proxy, backend) = match task % 2 {
            0 => (true, cut_off.clone()),
            _ => (false, other.clone()),
        };
        let (keys, tally) = (keys.clone(), tally.clone());
        tasks.push(tokio::spawn(async move {
            let mut round = task;
            while Instant::now() < until {
                round += 1;
                let index = (round % 4) as usize;
                let started = Instant::now();
                let wait = Duration::from_millis(500);
                let result = backend
                    .acquire("orders", &key(&format!("mixed-{index}")), wait)
                    .await;
                assert!(
                    started.elapsed() < wait + NETWORK + SLACK,
                    "an acquisition took {}",
                    ms(started.elapsed())
                );
                let Ok(lease) = result else {
                    tally.lock().unwrap().refused += 1;
                    continue;
                };
                // Up to a few liveness checks, so faults hit holders too.
                let hold = Duration::from_millis(round % 10 * 100);
                hold_checked(&keys[index], &tally, lease, through_proxy, hold).await;
            }
        }));
    }

    // Faults, in turn: silent for a while, then slower than the network timeout. The
    // cut-off instance holds the last key through each silence.
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(400)).await;
        if let Ok(lease) = cut_off
            .acquire("orders", &key("mixed-3"), Duration::from_secs(2))
            .await
        {
            let (keys, tally) = (keys.clone(), tally.clone());
            let hold = Duration::from_millis(1_200);
            tasks.push(tokio::spawn(async move {
                hold_checked(&keys[3], &tally, lease, true, hold).await;
            }));
        }
        proxy.blackhole();
        tokio::time::sleep(Duration::from_millis(900)).await;
        proxy.heal();
        tokio::time::sleep(Duration::from_millis(400)).await;
        proxy.delay(NETWORK * 2);
        tokio::time::sleep(Duration::from_millis(900)).await;
        proxy.delay(Duration::ZERO);
    }
    for task in tasks {
        tokio::time::timeout(PATIENCE, task)
            .await
            .expect("a task hung")
            .unwrap();
    }

    let tally = std::mem::take(&mut *tally.lock().unwrap());
    println!("mixed faults for {seconds} s: {tally:?}");
    assert_eq!(tally.unsignalled_overlaps, 0, "{tally:?}");
    assert_eq!(tally.token_regressions, 0, "{tally:?}");
    assert!(
        tally.granted_cut_off > 0 && tally.granted_direct > 0,
        "{tally:?}"
    );
    assert!(tally.lost > 0, "no fault hit a holder: {tally:?}");

    // Sessions whose client went away during a silence, holding a lock or not, end
    // at the server-side idle limit: none is stranded.
    let admin = admin(&pg).await;
    let stranded = || async {
        let sessions: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'cut-off' \
                 OR application_name LIKE 'tkl % cut-off'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        sessions as usize - cut_off.pool().status().size.min(sessions as usize)
    };
    println!(
        "mixed faults: {} stranded server sessions at the end",
        stranded().await
    );
    eventually("no server session is stranded", || async {
        stranded().await == 0
    })
    .await;

    // Healthy again: both instances serve, no restart.
    for backend in [&cut_off, &other] {
        let healed = Instant::now();
        loop {
            match backend
                .acquire("orders", &key("mixed-0"), Duration::from_secs(1))
                .await
            {
                Ok(lease) => break lease.release().await,
                Err(error) => assert!(healed.elapsed() < PATIENCE, "not serving: {error}"),
            }
        }
    }
}
