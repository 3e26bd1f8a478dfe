//! What the Redlock backend promises beyond the conformance suite, on five real
//! `redis-server` masters: a minority of masters killed or frozen changes nothing for
//! the holder or anyone else; a majority killed is an unavailable lock service, and the
//! holder is told at its deadline; a master restarted empty does not let a second
//! holder in (the restart guard, and the overlap without it); partial grants are given
//! back on every master; contention across instances has no unsignalled overlap; and
//! every configuration that needs fencing tokens is refused with Redlock's reason.
#![cfg(feature = "redis")]
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, Instant};
use tower_keyed_lock::backend::redlock::{RedlockBackend, NO_FENCING_TOKENS};
use tower_keyed_lock::backend::{LostReason, SetupError};
use tower_keyed_lock::{DistributedLocks, LeaseSignal, LockBackend, LockError};

use crate::support::fixtures::{self as servers, locks_on, within, Fixture, Redlock, PATIENCE};
use crate::support::redis_server::cli;
use crate::support::tcp_proxy::TcpProxy;

/// The fixture's lease (its `loss_bound`).
const LEASE: Duration = Duration::from_secs(1);

async fn instance(masters: &Redlock) -> DistributedLocks {
    masters.instance("instance").await
}

/// A backend on the masters, with the restart guard as asked.
async fn backend(masters: &Redlock, restart_guard: bool) -> RedlockBackend {
    Redlock::backend_on(masters.urls(), restart_guard).await
}

/// Whether master `index` has the lock key of `key` (any token).
fn holds(masters: &Redlock, probe: &RedlockBackend, index: usize, key: &str) -> bool {
    let lock = probe.lock_key(servers::NAME, key);
    cli(masters.0[index].port(), &["EXISTS", &lock]).trim() == "1"
}

/// Waits until no running master has the lock key of `key`; fails after `limit`.
async fn until_free_everywhere(
    masters: &Redlock,
    probe: &RedlockBackend,
    key: &str,
    limit: Duration,
) {
    let started = Instant::now();
    loop {
        let left: Vec<usize> = (0..masters.0.len())
            .filter(|&i| masters.0[i].is_running() && holds(masters, probe, i, key))
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "masters {left:?} still hold {key:?} {limit:?} after the attempt ended"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until every master is up for longer than the restart guard (a lease and a
/// second), so that only a restart in the test makes a master refuse to vote.
async fn past_the_restart_guard() {
    sleep(LEASE + Duration::from_millis(1100)).await;
}

/// Two of five masters killed while a key is held: renewals reach the other three, so
/// the holder keeps the key for several leases, and nobody else is granted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_masters_killed_mid_hold_leave_the_holder_exclusive() {
    let mut masters = Redlock::start();
    let (a, b) = (instance(&masters).await, instance(&masters).await);
    let guard = a.lock("k").await.unwrap();
    masters.0[0].stop();
    masters.0[1].stop();
    sleep(3 * LEASE).await;
    assert!(
        !guard.is_lost(),
        "renewal on 3 of 5 masters did not keep the lease"
    );
    assert!(matches!(b.try_lock("k").await, Err(LockError::Busy)));
    assert!(matches!(
        b.lock_timeout("k", Duration::from_millis(300)).await,
        Err(LockError::Timeout)
    ));
    assert!(!guard.is_lost());
    guard.release().await;
    // Three masters are a majority: the key is served on.
    let taken = within(
        "b takes the released key",
        PATIENCE,
        b.lock_timeout("k", PATIENCE),
    )
    .await
    .expect("3 of 5 masters grant");
    taken.release().await;
}

/// Three of five masters killed while a key is held: another instance's acquisition
/// fails as unavailable (503 through the layer) without waiting out its wait, and the
/// holder is told its lease is lost at its deadline (within a lease of the kill).
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_masters_killed_is_unavailable_and_the_holder_is_told_at_its_deadline() {
    use axum::routing::post;
    use tower_keyed_lock::KeyedLockLayer;

    let mut masters = Redlock::start();
    let (a, b) = (instance(&masters).await, instance(&masters).await);
    let app = axum::Router::new()
        .route("/jobs/{id}", post(|| async { "ran" }))
        .layer(
            KeyedLockLayer::by_path("id")
                .name(servers::NAME)
                .wait_timeout(Duration::from_secs(5))
                .backend(backend(&masters, false).await),
        );
    let server = crate::support::serve(app).await;
    let guard = a.lock("k").await.unwrap();
    let signal = guard.lease().expect("a remote lease").clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    let deadline_before_kill = guard.lease().unwrap().valid_until().expect("a deadline");
    for master in &mut masters.0[..3] {
        master.stop();
    }
    let killed = Instant::now();

    let started = Instant::now();
    let refused = b.lock_timeout("k", Duration::from_secs(5)).await;
    assert!(matches!(refused, Err(LockError::Backend(_))), "{refused:?}");
    let refused_after = started.elapsed();
    assert!(
        refused_after < Duration::from_secs(5),
        "an unavailable majority was waited out instead of refused"
    );
    let answer = server.post("/jobs/other").await;
    assert_eq!(
        answer.status,
        http::StatusCode::SERVICE_UNAVAILABLE,
        "{answer:?}"
    );

    let told = within("the holder is told", 2 * LEASE + PATIENCE, told)
        .await
        .unwrap();
    assert!(guard.is_lost());
    assert!(
        told >= deadline_before_kill,
        "told before the deadline it had when the masters died"
    );
    assert!(
        told - killed <= LEASE + Duration::from_secs(1),
        "told {:?} after the kill, more than a lease (and slack)",
        told - killed
    );
    eprintln!(
        "majority killed: acquisition refused after {refused_after:?}, holder told {:?} \
         after the kill",
        told - killed
    );
}

/// One master frozen (SIGSTOP: connections stay open, nothing answers) for three
/// leases while a key is held: the other four decide every attempt and renewal, the
/// holder keeps the key, and nobody else is granted it, during the freeze and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_paused_past_the_lease_leaves_the_holder_exclusive() {
    let masters = Redlock::start();
    let (a, b) = (instance(&masters).await, instance(&masters).await);
    let guard = a.lock("k").await.unwrap();
    masters.0[2].pause();
    let frozen = Instant::now();
    while frozen.elapsed() < 3 * LEASE {
        assert!(matches!(b.try_lock("k").await, Err(LockError::Busy)));
        sleep(Duration::from_millis(100)).await;
    }
    assert!(!guard.is_lost(), "a frozen master of five cost the lease");
    masters.0[2].resume();
    assert!(matches!(
        b.lock_timeout("k", Duration::from_millis(500)).await,
        Err(LockError::Timeout)
    ));
    assert!(!guard.is_lost());
    guard.release().await;
    within(
        "b takes the released key",
        PATIENCE,
        b.lock_timeout("k", PATIENCE),
    )
    .await
    .expect("granted")
    .release()
    .await;
}

/// The holder A got the key on masters 0, 1, 2 only (its path to 3 and 4 silent, as
/// in a partition). Master 2 then restarts empty, and instance B asks for the key:
/// 3 and 4 are free, 2 forgot. Returns whether B was granted while A still counted
/// its lease as valid (an unsignalled overlap: `is_lost()` read at B's grant), the
/// time between A's watcher waking and B's grant, and whether the watcher woke first.
async fn restart_mid_hold(restart_guard: bool) -> (bool, Duration, bool) {
    let mut masters = Redlock::start();
    past_the_restart_guard().await;
    let proxies = [
        TcpProxy::start(([127, 0, 0, 1], masters.0[3].port()).into()).await,
        TcpProxy::start(([127, 0, 0, 1], masters.0[4].port()).into()).await,
    ];
    let mut urls = masters.urls();
    urls[3] = format!("redis://{}/", proxies[0].host_port());
    urls[4] = format!("redis://{}/", proxies[1].host_port());
    let a = locks_on(Arc::new(Redlock::backend_on(urls, restart_guard).await));
    let b = locks_on(Arc::new(backend(&masters, restart_guard).await));
    let probe = backend(&masters, restart_guard).await;
    proxies.iter().for_each(TcpProxy::blackhole);

    let guard = a.lock("k").await.unwrap();
    assert!((0..3).all(|i| holds(&masters, &probe, i, "k")));
    assert!(!holds(&masters, &probe, 3, "k") && !holds(&masters, &probe, 4, "k"));
    let signal = guard.lease().unwrap().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    masters.0[2].restart();

    let taken = within("b is granted in the end", 3 * PATIENCE, async {
        loop {
            match b.lock_timeout("k", PATIENCE).await {
                Ok(taken) => break taken,
                Err(LockError::Backend(_)) => sleep(Duration::from_millis(50)).await,
                Err(error) => panic!("b: {error}"),
            }
        }
    })
    .await;
    let granted = Instant::now();
    let overlap = !guard.is_lost();
    let told = within("a is told", PATIENCE, told).await.unwrap();
    taken.release().await;
    let before = granted >= told;
    let gap = if before {
        granted - told
    } else {
        told - granted
    };
    (overlap, gap, before)
}

/// Master 2 of five restarts empty while A holds the key on 0, 1 and 2. With the
/// restart guard (the default), the restarted master votes for nobody until A's lease
/// has run out: B is granted only after A was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_restarted_empty_mid_hold_does_not_let_a_second_holder_in() {
    let (overlap, gap, told_first) = restart_mid_hold(true).await;
    assert!(
        !overlap,
        "b was granted while a still counted its lease as valid"
    );
    let order = if told_first {
        "before"
    } else {
        "(its watcher woke) after"
    };
    eprintln!("restart with the guard: a told {gap:?} {order} b was granted");
}

/// The same scenario without the restart guard: the restarted master's vote completes
/// a second majority (2, 3, 4) while A still counts its lease as valid. This is the
/// overlap the guard prevents; the test shows the scenario really exercises it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_restart_guard_a_restarted_master_lets_a_second_holder_in() {
    let (overlap, gap, told_first) = restart_mid_hold(false).await;
    assert!(
        overlap && !told_first,
        "expected b granted while a's lease was still valid (told first: {told_first}, {gap:?})"
    );
    eprintln!("restart without the guard: b granted {gap:?} before a was told");
}

/// An attempt that reaches no majority leaves nothing on any master: B gets masters 3
/// and 4 while A holds 0, 1, 2 (its path to 3 and 4 cut), and gives them back; and
/// with three masters killed, the two alive that granted are given back too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partial_grants_are_released_on_every_master() {
    let mut masters = Redlock::start();
    let proxies = [
        TcpProxy::start(([127, 0, 0, 1], masters.0[3].port()).into()).await,
        TcpProxy::start(([127, 0, 0, 1], masters.0[4].port()).into()).await,
    ];
    let mut urls = masters.urls();
    urls[3] = format!("redis://{}/", proxies[0].host_port());
    urls[4] = format!("redis://{}/", proxies[1].host_port());
    let a = locks_on(Arc::new(Redlock::backend_on(urls, false).await));
    let b = instance(&masters).await;
    let probe = backend(&masters, false).await;
    proxies.iter().for_each(TcpProxy::blackhole);
    let guard = a.lock("contended").await.unwrap();
    let refused = b
        .lock_timeout("contended", Duration::from_millis(300))
        .await;
    assert!(matches!(refused, Err(LockError::Timeout)), "{refused:?}");
    // Masters 3 and 4 granted b's attempts; every one was given back.
    let started = Instant::now();
    while holds(&masters, &probe, 3, "contended") || holds(&masters, &probe, 4, "contended") {
        assert!(
            started.elapsed() < servers::FREED_WITHIN,
            "b's partial grant was left on masters 3/4"
        );
        sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "partial grants: masters 3 and 4 free {:?} after the refused acquisition",
        started.elapsed()
    );
    drop(guard);

    for master in &mut masters.0[..3] {
        master.stop();
    }
    let refused = b.lock_timeout("alone", Duration::from_secs(1)).await;
    assert!(matches!(refused, Err(LockError::Backend(_))), "{refused:?}");
    until_free_everywhere(&masters, &probe, "alone", servers::FREED_WITHIN).await;
}

/// Three instances, three tasks each, on one key, while one master is killed and
/// another frozen midway: no two holders at once unless one of them had already been
/// told its lease was lost (an unsignalled overlap), and every turn is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contention_across_instances_has_no_unsignalled_overlap() {
    const TURNS: usize = 8;
    let mut masters = Redlock::start();
    // The leases held now, by turn number.
    let holders: Arc<std::sync::Mutex<Vec<(usize, LeaseSignal)>>> = Arc::default();
    let unsignalled = Arc::new(AtomicUsize::new(0));
    let turns = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let locks = instance(&masters).await;
        for _ in 0..3 {
            let (locks, holders) = (locks.clone(), holders.clone());
            let (unsignalled, turns) = (unsignalled.clone(), turns.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..TURNS {
                    let guard = locks.lock_timeout("counter", PATIENCE).await.unwrap();
                    let signal = guard.lease().unwrap().clone();
                    let turn = turns.fetch_add(1, SeqCst);
                    {
                        let mut holders = holders.lock().unwrap();
                        let others = holders.iter().filter(|(_, other)| !other.is_lost()).count();
                        if others > 0 && !signal.is_lost() {
                            unsignalled.fetch_add(1, SeqCst);
                        }
                        holders.push((turn, signal));
                    }
                    sleep(Duration::from_millis(5)).await;
                    holders.lock().unwrap().retain(|(held, _)| *held != turn);
                    guard.release().await;
                }
            }));
        }
    }
    sleep(Duration::from_millis(300)).await;
    masters.0[0].stop();
    masters.0[1].pause();
    sleep(Duration::from_millis(500)).await;
    masters.0[1].resume();
    for task in tasks {
        within("every turn", 3 * PATIENCE, task).await.unwrap();
    }
    assert_eq!(turns.load(SeqCst), 3 * 3 * TURNS);
    assert_eq!(unsignalled.load(SeqCst), 0, "unsignalled overlaps");
}

/// A proxy in front of each master: URLs that reach the masters through them.
async fn behind_proxies(masters: &Redlock) -> (Vec<TcpProxy>, Vec<String>) {
    let mut proxies = Vec::new();
    for master in &masters.0 {
        proxies.push(TcpProxy::start(([127, 0, 0, 1], master.port()).into()).await);
    }
    let urls = proxies
        .iter()
        .map(|proxy| format!("redis://{}/", proxy.host_port()))
        .collect();
    (proxies, urls)
}

/// The holder's path to every master goes silent (a partition: no reset, nothing
/// answers). Another instance waits for the key: the holder is told its lease is lost
/// before that instance is granted, and its own acquisitions on the silent path end
/// within their wait plus two command timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_off_holder_is_told_before_another_instance_is_granted() {
    let masters = Redlock::start();
    let (proxies, urls) = behind_proxies(&masters).await;
    let a = locks_on(Arc::new(Redlock::backend_on(urls, false).await));
    let b = instance(&masters).await;
    let guard = a.lock("cut").await.unwrap();
    let signal = guard.lease().unwrap().clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    proxies.iter().for_each(TcpProxy::blackhole);
    let cut = Instant::now();
    let taken = within(
        "b takes the key",
        3 * PATIENCE,
        b.lock_timeout("cut", 3 * PATIENCE),
    )
    .await
    .expect("b is granted once the holder's lease is gone");
    let granted = Instant::now();
    // "Lost" is a fact of the clock: the holder's own look at that instant decides.
    assert!(
        guard.is_lost(),
        "unsignalled overlap: b granted while a's lease was valid"
    );
    let told = within("a is told", PATIENCE, told).await.unwrap();
    eprintln!(
        "cut off: holder's watcher woke {:?} after the cut, other instance granted after \
         {:?} (margin {:?})",
        told - cut,
        granted - cut,
        granted.saturating_duration_since(told)
    );
    taken.release().await;

    let wait = Duration::from_millis(300);
    let bound = wait + 2 * servers::REDLOCK_COMMAND_TIMEOUT + Duration::from_secs(1);
    for key in ["silent-1", "silent-2"] {
        let started = Instant::now();
        let outcome = a.lock_timeout(key, wait).await;
        assert!(outcome.is_err(), "granted through a silent path");
        assert!(
            started.elapsed() < bound,
            "took {:?} (bound {bound:?})",
            started.elapsed()
        );
    }
}

/// Every path to the masters slower than usual but within the command timeout (a
/// quarter of it each way, per chunk): renewals still reach a majority in time, so the
/// holder keeps its lease for two leases and nobody else is granted the key. (Three
/// tries: on a loaded machine renewals may miss their time all the same, and the holder
/// must then be told.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_path_to_every_master_keeps_the_lease() {
    let masters = Redlock::start();
    let (proxies, urls) = behind_proxies(&masters).await;
    let a = locks_on(Arc::new(Redlock::backend_on(urls, false).await));
    let b = instance(&masters).await;
    let delay = |delay: Duration| proxies.iter().for_each(|proxy| proxy.delay(delay));
    let mut kept = false;
    for attempt in 1..=3 {
        let key = format!("slow-{attempt}");
        let guard = a.lock(&key).await.unwrap();
        delay(servers::REDLOCK_COMMAND_TIMEOUT / 4);
        sleep(2 * LEASE).await;
        match guard.lost_reason() {
            None => {
                assert!(matches!(b.try_lock(&key).await, Err(LockError::Busy)));
                kept = true;
            }
            Some(reason) => {
                assert!(
                    matches!(reason, LostReason::Unreachable | LostReason::Expired),
                    "a slow path within the command timeout lost the lease ({reason:?})"
                );
                println!("attempt {attempt}: renewals missed their time all the same; again");
            }
        }
        delay(Duration::ZERO);
        guard.release().await;
        if kept {
            break;
        }
    }
    assert!(kept, "in 3 tries a slow path never kept the lease");
}

/// Every connection of the holder to every master reset: the lease outlives its
/// connections (the keys keep their TTL), renewals reconnect; if the holder loses it
/// anyway, its lease is lost by its clock when another instance is granted. The same
/// backend serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reset_connections_to_every_master_signal_any_loss_and_recover() {
    let masters = Redlock::start();
    let (proxies, urls) = behind_proxies(&masters).await;
    let a = locks_on(Arc::new(Redlock::backend_on(urls, false).await));
    let b = instance(&masters).await;
    let guard = a.lock("reset").await.unwrap();
    proxies.iter().for_each(TcpProxy::reset);
    match b.lock_timeout("reset", 2 * LEASE).await {
        Ok(taken) => {
            assert!(guard.is_lost(), "unsignalled overlap after a reset");
            eprintln!("reset: lease lost, then granted elsewhere");
            taken.release().await;
        }
        Err(LockError::Timeout) => {
            assert!(!guard.is_lost(), "lost, yet nobody could take it");
            eprintln!("reset: lease kept");
        }
        Err(error) => panic!("b: {error}"),
    }
    drop(guard);
    let again = within("a reconnects", 3 * PATIENCE, async {
        loop {
            match a.lock_timeout("reset-after", PATIENCE).await {
                Ok(guard) => break guard,
                Err(_) => sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await;
    again.release().await;
}

/// How many `EVAL`s master `index` has run (give-backs and renewals are sent that way).
fn evals(masters: &Redlock, index: usize) -> u64 {
    let stats = crate::support::redis_server::info(masters.0[index].port(), "commandstats");
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_eval:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap())
}

/// A key held (without renewal, so the holder sends nothing meanwhile) while a master
/// is down, and another instance polling for it for a second: its attempts are refused
/// by the masters that hold the key, and the dead master's refused connection sent
/// nothing, so a poll leaves nothing to give back. Before, every poll gave its attempt
/// back on every master (30 in this second) and left a task retrying the dead one for
/// a minute. A command that found the connection still reconnecting times out instead
/// of being refused, and is given back: at most a few in the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn polling_with_a_master_down_sends_no_give_backs() {
    let mut masters = Redlock::start();
    let holder = RedlockBackend::builder(masters.urls())
        .lease(Duration::from_secs(10))
        .renewal(false)
        .restart_guard(false)
        .build()
        .await
        .unwrap();
    let a = locks_on(Arc::new(holder));
    let b = instance(&masters).await;
    let guard = a.lock("k").await.unwrap();
    masters.0[4].stop();
    // The first command after the kill finds the old connection broken (it may have
    // been sent): that attempt is given back. From then on the master refuses.
    assert!(matches!(b.try_lock("k").await, Err(LockError::Busy)));
    sleep(Duration::from_millis(200)).await;
    let before = evals(&masters, 0);
    let refused = b.lock_timeout("k", Duration::from_secs(1)).await;
    assert!(matches!(refused, Err(LockError::Timeout)), "{refused:?}");
    sleep(Duration::from_millis(200)).await;
    let give_backs = evals(&masters, 0) - before;
    eprintln!("polling with a master down: {give_backs} give-backs in 1 s");
    assert!(
        give_backs <= 3,
        "{give_backs} give-backs in 1 s of polling a held key"
    );
    guard.release().await;
}

/// Three instances `try_lock` a free key at the same instant, 20 rounds: never more
/// than one wins, and split votes (each got some masters, none a majority) are retried
/// within the command timeout, so that a round usually has a winner. How many did is
/// printed, not asserted (it depends on the machine's scheduling).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simultaneous_try_locks_never_grant_two() {
    const ROUNDS: usize = 20;
    let masters = Redlock::start();
    let instances = [
        instance(&masters).await,
        instance(&masters).await,
        instance(&masters).await,
    ];
    let mut won_rounds = 0;
    for round in 0..ROUNDS {
        let key = format!("round-{round}");
        let tries = instances.iter().map(|locks| locks.try_lock(&key));
        let outcomes = crate::support::join_all(tries).await;
        let mut winners = 0;
        for outcome in outcomes {
            match outcome {
                Ok(guard) => {
                    winners += 1;
                    guard.release().await;
                }
                Err(LockError::Busy) => {}
                Err(error) => panic!("try_lock: {error}"),
            }
        }
        assert!(
            winners <= 1,
            "round {round}: {winners} instances were granted"
        );
        won_rounds += winners;
    }
    eprintln!("simultaneous try_lock: {won_rounds} of {ROUNDS} rounds had a winner");
}

// ------------------------------------------------------------- fencing refusals

/// No lease carries a fencing token, and the backend says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_carry_no_fencing_token() {
    let masters = Redlock::start();
    let backend = backend(&masters, false).await;
    assert!(!backend.issues_fencing_tokens());
    assert_eq!(backend.no_fencing_tokens_reason(), Some(NO_FENCING_TOKENS));
    let locks = locks_on(Arc::new(backend));
    let guard = locks.lock("k").await.unwrap();
    assert_eq!(guard.fencing_token(), None);
    guard.release().await;
}

/// `fencing(true)`, carried over from a backend that fences, is refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fencing_true_is_refused_with_the_reason() {
    let masters = Redlock::start();
    let refused = RedlockBackend::builder(masters.urls())
        .fencing(true)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(refused, SetupError::Unsafe(_)), "{refused:?}");
    assert!(
        refused.to_string().ends_with(NO_FENCING_TOKENS),
        "{refused}"
    );
}

/// A replay store whose writes are fenced by the lock (the Redis store) under a
/// Redlock backend: `KeyedLockLayer::replay` panics with Redlock's reason.
#[cfg(all(feature = "replay", feature = "axum"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_replay_store_is_refused_by_replay_with_the_reason() {
    use tower_keyed_lock::replay::{RedisReplayStore, ReplayLayer};
    use tower_keyed_lock::{KeyedLockLayer, RedisBackend};

    let masters = Redlock::start();
    let redlock = backend(&masters, false).await;
    let store_server = RedisBackend::builder(masters.0[0].client())
        .restart_guard(false)
        .build()
        .await
        .unwrap();
    let lock = KeyedLockLayer::by_header("idempotency-key").backend(redlock);
    let replay = ReplayLayer::new(RedisReplayStore::new(&store_server));
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lock.replay(replay)));
    let Err(message) = refused else {
        panic!("KeyedLockLayer::replay accepted a fenced store under Redlock")
    };
    let message = message
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(message.contains(NO_FENCING_TOKENS), "{message}");
}

/// The same store with the layers stacked by hand: every request gets 500
/// problem+json (misconfigured) naming the reason, and the handler never runs.
#[cfg(all(feature = "replay", feature = "axum"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_replay_store_stacked_by_hand_is_refused_per_request() {
    use axum::routing::post;
    use tower_keyed_lock::replay::{RedisReplayStore, ReplayLayer};
    use tower_keyed_lock::{KeyedLockLayer, RedisBackend};

    let masters = Redlock::start();
    let store_server = RedisBackend::builder(masters.0[0].client())
        .restart_guard(false)
        .build()
        .await
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let handler = {
        let ran = ran.clone();
        move || async move {
            ran.fetch_add(1, SeqCst);
            "paid"
        }
    };
    let app = axum::Router::new()
        .route("/orders/{id}/pay", post(handler))
        .layer(ReplayLayer::new(RedisReplayStore::new(&store_server)))
        .layer(KeyedLockLayer::by_path("id").backend(backend(&masters, false).await));
    let server = crate::support::serve(app).await;
    let answer = server.post("/orders/1/pay").await;
    assert_eq!(
        answer.status,
        http::StatusCode::INTERNAL_SERVER_ERROR,
        "{answer:?}"
    );
    assert!(answer.body.contains("RedlockBackend"), "{}", answer.body);
    assert_eq!(ran.load(SeqCst), 0);
}

/// `message` names Redlock and each of `masters` (`host:port`), each followed by a
/// cause: in parentheses (an acquisition's error), or after a colon (a setup error's).
fn names_every_master(message: &str, masters: &[String]) {
    assert!(message.contains("Redlock"), "{message}");
    for master in masters {
        assert!(
            message.contains(&format!("{master} (")) || message.contains(&format!("at {master}: ")),
            "{master} not named with a cause: {message}"
        );
    }
}

/// Masters nothing listens on, at build and at an acquisition: the "no majority" error
/// names Redlock and every master that did not answer, with its cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_masters_are_named_with_their_addresses_and_causes() {
    // Ports nothing listens on: bound, then closed.
    let closed: Vec<String> = (0..3)
        .map(|_| {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            format!("127.0.0.1:{port}")
        })
        .collect();
    let urls: Vec<String> = closed.iter().map(|at| format!("redis://{at}")).collect();
    let error = RedlockBackend::builder(urls)
        .build()
        .await
        .map(|_| ())
        .expect_err("no master listens");
    let message = error.to_string();
    eprintln!("unreachable at build: {message}");
    assert!(matches!(error, SetupError::Failed { .. }), "{error:?}");
    names_every_master(&message, &closed);

    let mut masters = Redlock::start();
    let locks = instance(&masters).await;
    let stopped: Vec<String> = masters.urls()[..3]
        .iter()
        .map(|url| {
            url.trim_start_matches("redis://")
                .trim_end_matches('/')
                .to_owned()
        })
        .collect();
    for master in &mut masters.0[..3] {
        master.stop();
    }
    let error = locks
        .try_lock("k")
        .await
        .map(|_| ())
        .expect_err("no majority answers");
    let message = error.to_string();
    eprintln!("unreachable at acquire: {message}");
    names_every_master(&message, &stopped);
}

/// Distinct keys locked and released leave nothing on any master, and a held key's
/// holder record expires at most a lease after its lock would (a crashed holder's
/// goes by itself), so client-chosen keys cost the masters nothing once done.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn distinct_keys_leave_nothing_and_holder_records_expire_with_the_lock() {
    const KEYS: usize = 200;
    let masters = Redlock::start();
    let backend = backend(&masters, false).await;
    let locks = locks_on(Arc::new(backend.clone()));
    let guard = locks.lock("held").await.unwrap();
    let holder = backend
        .lock_key(servers::NAME, "held")
        .replace(":lock", ":holder");
    // A grant is a majority's: a master that answered late (or not at all, under load)
    // may hold no record (PTTL -2). A record without a TTL (-1), or one longer than the
    // bound, fails on any master.
    let most = i64::try_from((2 * LEASE).as_millis()).unwrap();
    let pttls: Vec<i64> = (masters.0.iter())
        .map(|master| {
            cli(master.port(), &["PTTL", &holder])
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    let holding = pttls
        .iter()
        .filter(|&&pttl| 0 < pttl && pttl <= most)
        .count();
    let absent = pttls.iter().filter(|&&pttl| pttl == -2).count();
    assert!(
        holding > masters.0.len() / 2 && holding + absent == masters.0.len(),
        "holder record PTTLs {pttls:?} ms: a majority within {most} ms, the rest absent"
    );
    guard.release().await;
    for n in 0..KEYS {
        let guard = locks.lock(&format!("order-{n}")).await.unwrap();
        guard.release().await;
    }
    // A release is done at a majority's answer; the others' follow in the background.
    // A given-back mark (an attempt a master answered after the majority was in, or
    // not at all) stays its documented minute; locks and holder records do not stay.
    let released = Instant::now();
    for (index, master) in masters.0.iter().enumerate() {
        loop {
            let keys = cli(master.port(), &["KEYS", "*"]);
            let left: Vec<&str> = keys
                .lines()
                .filter(|key| !key.is_empty() && !key.contains(":given-back:"))
                .collect();
            if left.is_empty() {
                break;
            }
            assert!(
                released.elapsed() < PATIENCE,
                "master {index} keeps {left:?}"
            );
            sleep(Duration::from_millis(10)).await;
        }
    }
}
