//! What the MySQL backend promises beyond the conformance suite, against a real
//! MariaDB server the tests start: long names hashed, a killed session or a paused
//! server raises the lost signal, fencing tokens survive a restart and a crash, a
//! proxy that multiplexes sessions is refused, and an acquisition cancelled at any
//! point leaves nothing held and no locked connection in the pool. A grant answered
//! late is `session_locks.rs`, shared with PostgreSQL.
#![cfg(feature = "mysql")]

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use crate::support::lateness::Lateness;
use crate::support::mysql_server::MySqlServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tower_keyed_lock::backend::mysql::{
    lock_name, MySqlBackend, MySqlBackendBuilder, DEFAULT_PREFIX,
};
use tower_keyed_lock::backend::SetupError;
use tower_keyed_lock::{DistributedLocks, Key, LockBackend, LockError};

const LIVENESS: Duration = Duration::from_millis(100);
const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);
/// Long enough for anything that should happen on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(10);
/// Slack on bounds the backend documents, for a loaded machine.
const SLACK: Duration = Duration::from_millis(500);
const NAME: &str = "jobs";

pub(crate) fn builder(url: &str) -> MySqlBackendBuilder {
    MySqlBackend::builder_from_url(url)
        .unwrap()
        .liveness_interval(LIVENESS)
        .command_timeout(COMMAND_TIMEOUT)
        .fencing(true)
}

/// [`builder`] as it is, connecting on first use.
fn backend(url: &str) -> MySqlBackend {
    builder(url).build_lazy()
}

fn locks(url: &str) -> DistributedLocks {
    DistributedLocks::new(NAME, backend(url))
}

/// The connection id holding `name` in the server, or `None` when it is free.
fn holder(server: &MySqlServer, name: &str) -> Option<u64> {
    let name = name.replace('\'', "''");
    server
        .admin(&format!("SELECT IS_USED_LOCK('{name}')"))
        .trim()
        .parse()
        .ok()
}

/// Takes `key` with `try_lock` until it is free, failing after `limit`.
async fn eventually_free(locks: &DistributedLocks, key: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        match locks.try_lock(key).await {
            Ok(guard) => return guard.release().await,
            Err(LockError::Busy) => {}
            Err(error) => panic!("try_lock({key:?}) failed: {error}"),
        }
        assert!(
            started.elapsed() < limit,
            "{key:?} still held {limit:?} after it should be free"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_names_are_hashed_stably_and_still_exclude() {
    let server = MySqlServer::start();
    let (a, b) = (locks(&server.url()), locks(&server.url()));
    let shared = "k".repeat(200);
    let (one, two) = (format!("{shared}-1"), format!("{shared}-2"));
    let guard = a.lock(&one).await.unwrap();
    // The server holds the hashed name, the one `lock_name` documents.
    let hashed = lock_name(DEFAULT_PREFIX, NAME, &one);
    assert_eq!(hashed.len(), 64);
    assert!(holder(&server, &hashed).is_some(), "{hashed} is not held");
    assert!(matches!(b.try_lock(&one).await, Err(LockError::Busy)));
    // A key that shares the first 64 bytes is another lock.
    let other = b
        .try_lock(&two)
        .await
        .expect("a different long key is free");
    other.release().await;
    guard.release().await;
    assert_eq!(holder(&server, &hashed), None);
    // A plain name stays readable in the server.
    let guard = a.lock("42").await.unwrap();
    assert!(holder(&server, &format!("{DEFAULT_PREFIX}:{NAME}:42")).is_some());
    guard.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_session_raises_the_lost_signal() {
    let server = MySqlServer::start();
    let (a, b) = (locks(&server.url()), locks(&server.url()));
    let guard = a.lock("k").await.unwrap();
    let name = lock_name(DEFAULT_PREFIX, NAME, "k");
    let id = holder(&server, &name).expect("held");
    let killed = Instant::now();
    server.admin(&format!("KILL {id}"));
    tokio::time::timeout(LIVENESS + COMMAND_TIMEOUT + SLACK, guard.lost())
        .await
        .expect("the holder of a killed session was not told");
    eprintln!("KILL: the holder was told after {:?}", killed.elapsed());
    assert!(guard.is_lost());
    let taken = b
        .lock_timeout("k", PATIENCE)
        .await
        .expect("the key is free");
    taken.release().await;
    drop(guard);
    // The backend recovers: the dead connection is not reused.
    let again = a.lock_timeout("k", PATIENCE).await.unwrap();
    again.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_is_a_lost_lease_and_no_hang() {
    let mut server = MySqlServer::start();
    let a = locks(&server.url());
    let guard = a.lock("k").await.unwrap();
    server.pause();
    let paused = Instant::now();
    tokio::time::timeout(LIVENESS + COMMAND_TIMEOUT + SLACK, guard.lost())
        .await
        .expect("the holder on a paused server was not told");
    let told = paused.elapsed();
    let wait = Duration::from_millis(300);
    let started = Instant::now();
    let outcome = a.lock_timeout("other", wait).await;
    assert!(outcome.is_err(), "granted by a paused server");
    assert!(
        started.elapsed() < wait + 2 * COMMAND_TIMEOUT + SLACK,
        "an acquisition on a paused server took {:?}",
        started.elapsed()
    );
    server.resume();
    drop(guard);
    eprintln!("paused: the holder was told after {told:?}");
    let again = a.lock_timeout("k", PATIENCE).await.unwrap();
    again.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_survive_a_restart_and_a_crash() {
    let mut server = MySqlServer::start();
    let a = locks(&server.url());
    let mut last = 0;
    let mut take = |token: Option<u64>, when: &str| {
        let token = token.expect("fencing is on");
        assert!(token > last, "token {token} after {last} ({when})");
        last = token;
    };
    for _ in 0..3 {
        let guard = a.lock_timeout("k", PATIENCE).await.unwrap();
        take(guard.fencing_token(), "before the restart");
        guard.release().await;
    }
    tokio::task::block_in_place(|| {
        server.stop();
        server.start_again();
    });
    // The backend's pooled connection died with the server: it reconnects by itself.
    let guard = a.lock_timeout("k", PATIENCE).await.unwrap();
    take(guard.fencing_token(), "after a clean restart");
    guard.release().await;
    tokio::task::block_in_place(|| {
        server.kill();
        server.start_again();
    });
    let guard = locks(&server.url())
        .lock_timeout("k", PATIENCE)
        .await
        .unwrap();
    take(guard.fencing_token(), "after a crash");
    guard.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_fencing_tables_are_refused_by_name() {
    let server = MySqlServer::start();
    server.admin(&format!(
        "CREATE TABLE {}.volatile (id TINYINT UNSIGNED PRIMARY KEY, token BIGINT UNSIGNED NOT NULL) ENGINE = MEMORY",
        crate::support::mysql_server::DATABASE
    ));
    let refused = DistributedLocks::new(
        NAME,
        builder(&server.url())
            .fencing_table("volatile")
            .build_lazy(),
    );
    let error = refused.lock_timeout("k", PATIENCE).await.unwrap_err();
    let message = format!("{error}: {:?}", std::error::Error::source(&error));
    assert!(message.contains("InnoDB"), "{message}");
    // Without a database, an unqualified table is refused too.
    let url = server.url().replace(
        &format!("/{}?", crate::support::mysql_server::DATABASE),
        "/?",
    );
    let error = locks(&url).lock_timeout("k", PATIENCE).await.unwrap_err();
    let message = format!("{error}: {:?}", std::error::Error::source(&error));
    assert!(message.contains("no database"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counter_table_is_created_once_by_instances_starting_together() {
    let server = MySqlServer::start();
    let instances: Vec<_> = (0..8).map(|_| locks(&server.url())).collect();
    let takes = instances.iter().enumerate().map(|(n, locks)| {
        let locks = locks.clone();
        tokio::spawn(async move {
            let guard = locks.lock_timeout(&format!("key-{n}"), PATIENCE).await;
            let guard = guard.expect("every instance starts");
            let token = guard.fencing_token().unwrap();
            guard.release().await;
            token
        })
    });
    let mut tokens = Vec::new();
    for take in takes {
        tokens.push(take.await.unwrap());
    }
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 8, "two grants shared a token: {tokens:?}");
    // Quietly: no warning left by the creation on a session.
    let tables = server.admin(&format!(
        "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '{}'",
        crate::support::mysql_server::DATABASE
    ));
    assert_eq!(tables.trim(), "1");
}

/// A proxy that pins each client connection to a server connection until
/// [`swap`](SwapProxy::swap) hands the first two clients each other's server session
/// — what a multiplexing proxy does between statements.
struct SwapProxy {
    port: u16,
    swapped: Arc<AtomicBool>,
}

impl SwapProxy {
    async fn start(upstream: u16) -> SwapProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let swapped = Arc::new(AtomicBool::new(false));
        let clients: Arc<Mutex<Vec<Arc<Mutex<OwnedWriteHalf>>>>> = Arc::default();
        let servers: Arc<Mutex<Vec<Arc<Mutex<OwnedWriteHalf>>>>> = Arc::default();
        let route = {
            let swapped = swapped.clone();
            move |index: usize| match (swapped.load(SeqCst), index) {
                (true, 0) => 1,
                (true, 1) => 0,
                (_, index) => index,
            }
        };
        tokio::spawn(async move {
            let mut index = 0;
            while let Ok((client, _)) = listener.accept().await {
                let server = TcpStream::connect(("127.0.0.1", upstream)).await.unwrap();
                let (mut client_read, client_write) = client.into_split();
                let (mut server_read, server_write) = server.into_split();
                clients
                    .lock()
                    .await
                    .push(Arc::new(Mutex::new(client_write)));
                servers
                    .lock()
                    .await
                    .push(Arc::new(Mutex::new(server_write)));
                // Client `index` → the server connection it is routed to now.
                let (to_servers, route_up) = (servers.clone(), route.clone());
                tokio::spawn(async move {
                    let mut buffer = vec![0; 16 * 1024];
                    while let Ok(n @ 1..) = client_read.read(&mut buffer).await {
                        let target = to_servers.lock().await.get(route_up(index)).cloned();
                        let Some(target) = target else { break };
                        if target.lock().await.write_all(&buffer[..n]).await.is_err() {
                            break;
                        }
                    }
                });
                // Server connection `index` → the client routed to it now.
                let (to_clients, route_down) = (clients.clone(), route.clone());
                tokio::spawn(async move {
                    let mut buffer = vec![0; 16 * 1024];
                    while let Ok(n @ 1..) = server_read.read(&mut buffer).await {
                        let target = to_clients.lock().await.get(route_down(index)).cloned();
                        let Some(target) = target else { break };
                        if target.lock().await.write_all(&buffer[..n]).await.is_err() {
                            break;
                        }
                    }
                });
                index += 1;
            }
        });
        SwapProxy { port, swapped }
    }

    fn swap(&self) {
        self.swapped.store(true, SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_multiplexes_sessions_is_refused() {
    let server = MySqlServer::start();
    let proxy = SwapProxy::start(server.port()).await;
    let a = locks(&server.url_via(&format!("127.0.0.1:{}", proxy.port)));
    // Client connection 0 holds "k"; connection 1 served "other" and sits in the pool.
    let guard = a.lock("k").await.unwrap();
    a.lock("other").await.unwrap().release().await;
    proxy.swap();
    tokio::time::timeout(LIVENESS + COMMAND_TIMEOUT + SLACK, guard.lost())
        .await
        .expect("a holder whose session was handed to another client was not told");
    drop(guard);
    // The pooled connection now talks to the session that holds "k": refused by name,
    // never granted again. (The release waits up to a network timeout for the closed
    // session to end, which here it never does: its connection went to another client.)
    let refused = a.lock_timeout("k", COMMAND_TIMEOUT + SLACK).await;
    match refused {
        Err(LockError::Backend(error)) => {
            assert!(error.to_string().contains("multiplexes"), "{error}")
        }
        other => panic!("a multiplexed session was not refused: {other:?}"),
    }
}

/// An acquisition dropped at any point — connecting, checking the server, creating the
/// counter table, in `GET_LOCK` (free or waiting), taking the token — leaves the key
/// free at once and no locked connection in the pool. The raw backend future is cut
/// (the layer would detach it): this is the backend's own cancel safety.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_cancelled_at_any_await_leaves_nothing_held() {
    let server = MySqlServer::start();
    let other = locks(&server.url());
    let key = Key::new("cut", 256).unwrap();
    // How long a whole acquisition takes from a cold backend, and from a warm one.
    let cold = {
        let backend = backend(&server.url());
        let started = Instant::now();
        let lease = backend.acquire(NAME, &key, PATIENCE).await.unwrap();
        let took = started.elapsed();
        lease.release().await;
        took
    };
    let freed_within = COMMAND_TIMEOUT + SLACK;
    let warm = backend(&server.url());
    warm.acquire(NAME, &key, PATIENCE)
        .await
        .unwrap()
        .release()
        .await;
    for step in 0..=24u32 {
        let cut = cold * step / 20;
        // A cold backend: the cut lands in connecting, the first-use checks, the lock.
        let cold_backend = backend(&server.url());
        let _ = tokio::time::timeout(cut, cold_backend.acquire(NAME, &key, PATIENCE)).await;
        eventually_free(&other, "cut", freed_within).await;
        // A warm one: in GET_LOCK or the token; then its pool must hold nothing locked.
        let _ = tokio::time::timeout(cut / 4, warm.acquire(NAME, &key, PATIENCE)).await;
        eventually_free(&other, "cut", freed_within).await;
        let lease = tokio::time::timeout(PATIENCE, warm.acquire(NAME, &key, Duration::ZERO))
            .await
            .expect("an acquisition on a free key")
            .expect("the warm backend's pool holds no locked connection");
        lease.release().await;
        // Waiting behind another holder: cut while queued in the server.
        let held = other.lock("cut").await.unwrap();
        let _ = tokio::time::timeout(cut, warm.acquire(NAME, &key, PATIENCE)).await;
        held.release().await;
        eventually_free(&other, "cut", freed_within).await;
    }
    eprintln!("cut points up to {:?}", cold * 24 / 20);
}

/// Who holds a key, as far as the instances know: each grant registers its signal, each
/// release removes it.
#[derive(Default)]
struct Registry {
    holders: std::collections::HashMap<String, (u64, tower_keyed_lock::LeaseSignal)>,
    last_token: std::collections::HashMap<String, u64>,
    next_id: u64,
    grants: usize,
    unsignalled_overlaps: usize,
    regressions: usize,
}

/// Two instances (one through the fault proxy), six tasks each on four keys, while the
/// proxy goes silent, slow past the network timeout and slow within it, in turn: no
/// grant while another holder of the key is not yet told (by the clock, which is what
/// `is_lost` reads), fencing tokens never go back, and both instances serve when the
/// path heals. (A reset frees the key in the server before the holder's next check
/// tells it: that bound is the conformance suite's `reset_notice`, not checked here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_in_turn_never_grant_a_key_twice_unsignalled() {
    let server = MySqlServer::start();
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], server.port()));
    let proxy = Arc::new(crate::support::tcp_proxy::TcpProxy::start(upstream).await);
    let instances = [
        locks(&server.url_via(&proxy.host_port())),
        locks(&server.url()),
    ];
    let registry = Arc::new(std::sync::Mutex::new(Registry::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for task in 0..12usize {
        let locks = instances[task % 2].clone();
        let (registry, stop) = (registry.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut turn = task;
            while !stop.load(SeqCst) {
                turn += 1;
                let key = format!("k{}", turn % 4);
                let Ok(guard) = locks.lock_timeout(&key, Duration::from_secs(1)).await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let signal = guard.lease().expect("a remote lease").clone();
                let token = guard.fencing_token().expect("fencing is on");
                let id = {
                    let mut registry = registry.lock().unwrap();
                    registry.grants += 1;
                    if let Some((_, other)) = registry.holders.get(&key) {
                        if !other.is_lost() {
                            registry.unsignalled_overlaps += 1;
                        }
                    }
                    if registry
                        .last_token
                        .get(&key)
                        .is_some_and(|last| *last >= token)
                    {
                        registry.regressions += 1;
                    }
                    registry.last_token.insert(key.clone(), token);
                    registry.next_id += 1;
                    let id = registry.next_id;
                    registry.holders.insert(key.clone(), (id, signal));
                    id
                };
                tokio::time::sleep(Duration::from_millis(50 + (turn as u64 * 37) % 250)).await;
                {
                    let mut registry = registry.lock().unwrap();
                    if registry
                        .holders
                        .get(&key)
                        .is_some_and(|(holder, _)| *holder == id)
                    {
                        registry.holders.remove(&key);
                    }
                }
                guard.release().await;
            }
        }));
    }
    let faults: [(&str, Duration); 6] = [
        ("silent", Duration::from_millis(1500)),
        ("heal", Duration::from_millis(800)),
        ("slow past the timeout", Duration::from_millis(1500)),
        ("slow within the timeout", Duration::from_millis(1000)),
        ("silent", Duration::from_millis(1500)),
        ("heal", Duration::from_millis(800)),
    ];
    for (fault, lasting) in faults {
        match fault {
            "silent" => proxy.blackhole(),
            "heal" => {
                proxy.delay(Duration::ZERO);
                proxy.heal();
            }
            "slow past the timeout" => proxy.delay(Duration::from_millis(400)),
            _ => proxy.delay(Duration::from_millis(60)),
        }
        tokio::time::sleep(lasting).await;
    }
    proxy.delay(Duration::ZERO);
    proxy.heal();
    stop.store(true, SeqCst);
    for task in tasks {
        tokio::time::timeout(PATIENCE, task)
            .await
            .expect("a task hung")
            .unwrap();
    }
    for locks in &instances {
        let served = locks.lock_timeout("after", PATIENCE).await;
        served
            .expect("both instances serve after the faults")
            .release()
            .await;
    }
    let registry = registry.lock().unwrap();
    eprintln!(
        "faults in turn: {} grants, {} unsignalled overlaps, {} token regressions",
        registry.grants, registry.unsignalled_overlaps, registry.regressions
    );
    assert!(registry.grants > 10, "too few grants to mean anything");
    assert_eq!(registry.unsignalled_overlaps, 0);
    assert_eq!(registry.regressions, 0);
}

/// Releases that land while a liveness check is in flight (a check every millisecond):
/// the check's answer is still on its way, so the connection must not serve another
/// statement — it would read that answer as its own (a `GET_LOCK` answered by a stale
/// "1" looks granted). Every grant is real (the server names its holder), every
/// acquisition succeeds, and a release returns with the key free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_during_a_liveness_check_never_desyncs_the_connection() {
    let server = MySqlServer::start();
    let checked_often = MySqlBackend::builder_from_url(&server.url())
        .unwrap()
        .liveness_interval(Duration::from_millis(1))
        .command_timeout(COMMAND_TIMEOUT)
        .fencing(true)
        .build_lazy();
    let a = DistributedLocks::new(NAME, checked_often);
    let b = locks(&server.url());
    let name = lock_name(DEFAULT_PREFIX, NAME, "k");
    let mut last_token = 0;
    for turn in 0..150u64 {
        let guard = a
            .lock_timeout("k", PATIENCE)
            .await
            .unwrap_or_else(|error| panic!("turn {turn}: {error}"));
        let token = guard.fencing_token().unwrap();
        assert!(
            token > last_token,
            "turn {turn}: token {token} after {last_token}"
        );
        last_token = token;
        if turn % 10 == 0 {
            assert!(
                holder(&server, &name).is_some(),
                "turn {turn}: granted, yet not held"
            );
            assert!(matches!(b.try_lock("k").await, Err(LockError::Busy)));
        }
        // Let a check or two run, and release at varying points of one.
        tokio::time::sleep(Duration::from_micros(500 + 37 * (turn % 40))).await;
        guard.release().await;
        if turn % 10 == 5 {
            // `release().await` returns once the key is free.
            let free = b.try_lock("k").await;
            free.unwrap_or_else(|error| panic!("turn {turn}: released, yet {error:?}"))
                .release()
                .await;
        }
    }
}

/// A holds, B waits, A's session is killed by its connection id: A must be told its
/// lease is lost as B is granted, not at its next liveness check. The holder keeps a
/// statement pending on its session, which the kill fails at once; without it, A heard
/// of the kill only at its next check, after B's grant. The server fails A's statement
/// before it frees the lock, but A and B read their answers on two connections of one
/// loaded process: A may be told after B's grant by no more than what the load costs,
/// measured here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_is_told_as_the_next_holder_is_granted() {
    let lateness = Lateness::watch();
    let server = MySqlServer::start();
    let (a, b) = (locks(&server.url()), locks(&server.url()));
    let guard = a.lock("k").await.unwrap();
    let id = holder(&server, &lock_name(DEFAULT_PREFIX, NAME, "k")).expect("held");
    let waiter = tokio::spawn(async move {
        let taken = b
            .lock_timeout("k", PATIENCE)
            .await
            .expect("the key is free");
        let granted = Instant::now();
        taken.release().await;
        granted
    });
    // When A is told, seen by a task of its own (as B's grant is).
    let signal = guard.lease().expect("a remote lease").clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    // Let B's GET_LOCK reach the server and wait there.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The client runs as a process: off the runtime's worker threads.
    tokio::task::block_in_place(|| server.admin(&format!("KILL {id}")));
    let told = tokio::time::timeout(PATIENCE, told)
        .await
        .expect("the holder of a killed session was never told")
        .unwrap();
    let granted = waiter.await.unwrap();
    let allowed = lateness.allowing(Duration::ZERO);
    assert!(
        told <= granted + allowed,
        "B was granted {:?} before A was told, more than the load allows ({allowed:?})",
        told - granted
    );
    match granted.checked_duration_since(told) {
        Some(before) => eprintln!("KILL: A was told {before:?} before B's grant"),
        None => eprintln!("KILL: A was told {:?} after B's grant", told - granted),
    }
}

/// A server crash (SIGKILL) or a clean stop ends the holder's session: the holder is
/// told as its connection closes, not at its next liveness check (here 2 s apart, so a
/// check could come up to 2 s later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_or_stop_tells_the_holder_at_once() {
    let interval = Duration::from_secs(2);
    let mut server = MySqlServer::start();
    let backend = MySqlBackend::builder_from_url(&server.url())
        .unwrap()
        .liveness_interval(interval)
        .command_timeout(COMMAND_TIMEOUT)
        .fencing(true)
        .build_lazy();
    let a = DistributedLocks::new(NAME, backend);
    for crash in [true, false] {
        let guard = a.lock_timeout("k", PATIENCE).await.unwrap();
        let signal = guard.lease().expect("a remote lease").clone();
        let told = tokio::spawn(async move {
            signal.lost().await;
            Instant::now()
        });
        // Both return once the server process is gone.
        let gone = tokio::task::block_in_place(|| {
            match crash {
                true => server.kill(),
                false => server.stop(),
            }
            Instant::now()
        });
        let told = tokio::time::timeout(PATIENCE, told)
            .await
            .expect("the holder was never told")
            .unwrap();
        let late = told.saturating_duration_since(gone);
        let what = if crash { "crash" } else { "stop" };
        match gone.checked_duration_since(told) {
            Some(early) => {
                eprintln!("server {what}: the holder was told {early:?} before the server was gone")
            }
            None => {
                eprintln!("server {what}: the holder was told {late:?} after the server was gone")
            }
        }
        assert!(
            late < interval / 10,
            "server {what}: the holder was told {late:?} after the server was gone"
        );
        drop(guard);
        tokio::task::block_in_place(|| server.start_again());
    }
}

/// A holder whose session was killed releases: the release reports the lock as already
/// gone (the lease was lost), where it used to answer as if it had been given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_reports_a_lock_already_gone() {
    let server = MySqlServer::start();
    let a = locks(&server.url());
    // A lock held to the end is given back: nothing to report.
    let guard = a.lock("k").await.unwrap();
    guard.release_checked().await.expect("held until released");
    let guard = a.lock("k").await.unwrap();
    let id = holder(&server, &lock_name(DEFAULT_PREFIX, NAME, "k")).expect("held");
    server.admin(&format!("KILL {id}"));
    let gone = guard
        .release_checked()
        .await
        .expect_err("the lock was gone");
    eprintln!("release after KILL: {gone}");
    assert_eq!(
        gone.reason(),
        tower_keyed_lock::backend::LostReason::Unreachable
    );
    assert!(gone.to_string().contains("lost"), "{gone}");
    // The raw lease reports it too.
    let backend = backend(&server.url());
    let key = Key::new("raw", 256).unwrap();
    let lease = backend.acquire(NAME, &key, PATIENCE).await.unwrap();
    let id = holder(&server, &lock_name(DEFAULT_PREFIX, NAME, "raw")).expect("held");
    server.admin(&format!("KILL {id}"));
    assert!(lease.release_checked().await.is_err());
    let lease = backend.acquire(NAME, &key, PATIENCE).await.unwrap();
    assert_eq!(lease.release_checked().await, Ok(()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_named_with_its_address_and_cause() {
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let locks = locks(&format!("mysql://locker:s3cret-pw@127.0.0.1:{port}/test"));
    let started = Instant::now();
    let error = locks
        .lock_timeout("k", PATIENCE)
        .await
        .map(|_| ())
        .expect_err("nothing listens there");
    // A server that never answered is told at once, not waited out.
    assert!(
        started.elapsed() < PATIENCE / 2,
        "took {:?}",
        started.elapsed()
    );
    let message = error.to_string();
    eprintln!("unreachable: {message}");
    assert!(message.contains("MySQL"), "{message}");
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(
        !message.contains("s3cret-pw"),
        "the password leaked: {message}"
    );
    // The cause follows the address.
    let address_end = message.find(&format!("{port}")).unwrap() + port.to_string().len();
    assert!(message.len() > address_end + 2, "no cause: {message}");
}

/// `build` connects and checks the server before handing out the backend: against
/// nothing it fails with the address (never the password) and the cause; against a
/// server it builds a backend that locks, and refuses a fencing table that could lose
/// its counter, as the first acquisition of a lazily built backend does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn build_checks_the_server_first() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("mysql://locker:s3cret-pw@127.0.0.1:{port}/test");
    let error = builder(&url)
        .build()
        .await
        .expect_err("nothing listens there");
    let message = error.to_string();
    eprintln!("unreachable at build: {message}");
    assert!(matches!(error, SetupError::Failed { .. }), "{error:?}");
    assert!(
        message.contains(&format!(
            "MySQL lock backend setup failed: at 127.0.0.1:{port}: "
        )),
        "{message}"
    );
    assert!(
        !message.contains("s3cret-pw"),
        "the password leaked: {message}"
    );

    let server = MySqlServer::start();
    let built = builder(&server.url())
        .build()
        .await
        .expect("a server to build on");
    let locks = DistributedLocks::new(NAME, built);
    let guard = locks.try_lock("k").await.expect("a free key");
    assert!(guard.fencing_token().is_some());
    guard.release().await;

    server.admin(&format!(
        "CREATE TABLE {}.volatile (id TINYINT UNSIGNED PRIMARY KEY, token BIGINT UNSIGNED NOT NULL) ENGINE = MEMORY",
        crate::support::mysql_server::DATABASE
    ));
    let refused = builder(&server.url())
        .fencing_table("volatile")
        .build()
        .await
        .expect_err("a MEMORY table loses its counter on a restart");
    assert!(refused.to_string().contains("InnoDB"), "{refused}");
}
