//! The Redis backend on a real Redis Cluster (three primaries with a replica each, on
//! free ports): the cross-instance guarantees, release notifications on shard
//! channels, a slot moved mid-wait, and a primary killed in the middle of a run.
//!
//! Figures: `cargo test --all-features --test backends redis_cluster:: -- --nocapture`; the
//! run's length: `CLUSTER_SOAK_SECS` (default 6).
#![cfg(feature = "redis")]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_keyed_lock::backend::redis::RedisBackend;
use tower_keyed_lock::{Key, LockBackend, LockError};

use crate::support::fixtures::within;
use crate::support::redis_cluster::RedisCluster;
use crate::support::redis_server::cli;

const COMMAND_TIMEOUT: Duration = Duration::from_millis(500);

/// An instance on the cluster. The restart guard is off: the nodes are fresh.
async fn instance(cluster: &RedisCluster, poll: Duration) -> RedisBackend {
    RedisBackend::cluster_builder(cluster.client())
        .lease(Duration::from_secs(2))
        .command_timeout(COMMAND_TIMEOUT)
        .poll_interval(poll)
        .restart_guard(false)
        .build()
        .await
        .expect("backend connects to the cluster")
}

fn key(text: &str) -> Key {
    Key::new(text, 256).unwrap()
}

/// Waits (at most 5 s) until the shard channel of `lock` has `count` subscribers.
async fn subscribers_reach(cluster: &RedisCluster, lock: &str, count: usize, what: &str) {
    within(what, Duration::from_secs(5), async {
        while cluster.shard_subscribers(lock) != count {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// Keys spread over the three primaries, one instance contending from each side, and
/// a release heard on the other instance through the subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_on_every_shard_are_serialized_and_releases_wake_other_instances() {
    let cluster = RedisCluster::start();
    // Waiters wake by release messages only: the poll is longer than the test.
    let poll = Duration::from_secs(30);
    let instances = [
        instance(&cluster, poll).await,
        instance(&cluster, poll).await,
    ];
    let keys: Vec<String> = (0..12).map(|i| format!("order-{i}")).collect();
    let shards: std::collections::HashSet<_> = keys
        .iter()
        .map(|k| cluster.primary_of(&instances[0].lock_key("cluster", k)))
        .collect();
    assert_eq!(shards.len(), 3, "the keys should cover every primary");

    let running: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (i, name) in keys.iter().enumerate() {
        for backend in &instances {
            let (backend, name) = (backend.clone(), name.clone());
            let (running, overlaps) = (running.clone(), overlaps.clone());
            tasks.push(tokio::spawn(async move {
                let mut last = 0;
                for _ in 0..5 {
                    let lease = backend
                        .acquire("cluster", &key(&name), Duration::from_secs(10))
                        .await
                        .expect("granted");
                    let token = lease.fencing_token().unwrap();
                    assert!(token > last, "token {token} after {last}");
                    last = token;
                    {
                        let mut running = running.lock().unwrap();
                        let count = running.entry(name.clone()).or_default();
                        *count += 1;
                        if *count > 1 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2 + (i as u64 % 3))).await;
                    *running.lock().unwrap().get_mut(&name).unwrap() -= 1;
                    lease.release().await;
                }
            }));
        }
    }
    within("the contended rounds", Duration::from_secs(30), async {
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two holders of one key at once"
    );

    // A release on one instance wakes the waiter on the other at once.
    for name in &keys[..3] {
        let held = instances[0]
            .acquire("cluster", &key(name), Duration::ZERO)
            .await
            .unwrap();
        let waiter = {
            let (backend, name) = (instances[1].clone(), name.clone());
            tokio::spawn(async move {
                backend
                    .acquire("cluster", &key(&name), Duration::from_secs(20))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The waiter listens on the lock's own shard channel, not a broadcast one.
        let lock = instances[0].lock_key("cluster", name);
        assert_eq!(
            cluster.shard_subscribers(&lock),
            1,
            "{lock} subscribed once"
        );
        assert_eq!(cluster.subscribers("keyed-lock:release"), 0);
        let released = Instant::now();
        held.release().await;
        let lease = within("the waiter wakes", Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        let woken = released.elapsed();
        println!("cluster: waiter on {name} woken {woken:?} after the release");
        assert!(
            woken < Duration::from_secs(1),
            "woken {woken:?} after: by the poll"
        );
        lease.release().await;
        // With its last waiter gone, the channel is given up.
        subscribers_reach(&cluster, &lock, 0, "the shard channel is unsubscribed").await;
    }
}

/// A waiter dropped mid-wait takes its shard channel subscription with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_waiter_gives_up_its_shard_channel() {
    let cluster = RedisCluster::start();
    let poll = Duration::from_secs(30);
    let instances = [
        instance(&cluster, poll).await,
        instance(&cluster, poll).await,
    ];
    let lock = instances[0].lock_key("cluster", "cancelled");
    let held = instances[0]
        .acquire("cluster", &key("cancelled"), Duration::ZERO)
        .await
        .unwrap();
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let backend = instances[1].clone();
            tokio::spawn(async move {
                backend
                    .acquire("cluster", &key("cancelled"), Duration::from_secs(20))
                    .await
            })
        })
        .collect();
    subscribers_reach(&cluster, &lock, 1, "the waiters subscribe").await;
    for waiter in &waiters {
        waiter.abort();
    }
    subscribers_reach(&cluster, &lock, 0, "the shard channel is given up").await;
    held.release().await;
    // Nothing was left held by the cancelled waiters.
    let lease = instances[1]
        .acquire("cluster", &key("cancelled"), Duration::ZERO)
        .await
        .expect("free after the holder released");
    lease.release().await;
}

/// The slot of a held key moves to another primary while another instance waits for
/// it. The server drops the waiter's shard channel with the slot; the subscription
/// follows the slot to its new primary, and the release there wakes the waiter at
/// once. The holder keeps its lease throughout (the lock key moved with its TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_moved_mid_wait_keeps_the_lock_and_the_wake_up() {
    let cluster = RedisCluster::start();
    let poll = Duration::from_secs(30);
    let instances = [
        instance(&cluster, poll).await,
        instance(&cluster, poll).await,
    ];
    for round in 0..3 {
        let name = format!("moving-{round}");
        let lock = instances[0].lock_key("cluster", &name);
        let held = instances[0]
            .acquire("cluster", &key(&name), Duration::ZERO)
            .await
            .unwrap();
        let waiter = {
            let (backend, name) = (instances[1].clone(), name.clone());
            tokio::spawn(async move {
                backend
                    .acquire("cluster", &key(&name), Duration::from_secs(20))
                    .await
            })
        };
        subscribers_reach(&cluster, &lock, 1, "the waiter subscribes").await;

        let from = cluster.primary_of(&lock);
        let to = *cluster.primaries().iter().find(|&&p| p != from).unwrap();
        cluster.move_slot_of(&lock, to);
        assert_eq!(cluster.primary_of(&lock), to);
        let followed = Instant::now();
        subscribers_reach(&cluster, &lock, 1, "the subscription follows the slot").await;
        println!(
            "cluster slot move: shard channel back on the new primary {:?} after the move",
            followed.elapsed()
        );
        assert!(!waiter.is_finished(), "the waiter was granted a held key");
        assert!(
            !held.signal().is_lost(),
            "the move cost the holder its lease"
        );

        let released = Instant::now();
        held.release().await;
        let lease = within("the waiter wakes", Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .expect("granted after the move");
        let woken = released.elapsed();
        println!("cluster slot move: waiter woken {woken:?} after the release");
        assert!(
            woken < Duration::from_secs(1),
            "woken {woken:?} after: by the poll"
        );
        lease.release().await;
    }
}

/// A primary is killed (SIGKILL) in the middle of a run of two instances over keys on
/// every shard, and later a slot is moved to another primary. No two unsignalled
/// holders of a key overlap, no acquisition outlasts its wait by more than a command
/// timeout, and once the replica has taken over, keys of the failed shard are granted
/// again without restarting anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_killed_mid_run_fails_over_without_overlap_or_hang() {
    let mut cluster = RedisCluster::start();
    let seconds: u64 = std::env::var("CLUSTER_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let instances = [
        instance(&cluster, Duration::from_millis(200)).await,
        instance(&cluster, Duration::from_millis(200)).await,
    ];
    let keys: Vec<String> = (0..24).map(|i| format!("k{i}")).collect();
    let victim_key = instances[0].lock_key("soak", &keys[0]);
    let victim = cluster.primary_of(&victim_key);

    /// The holder of a key now, and whether its lease was signalled lost.
    type Holders = Mutex<HashMap<String, (u64, tower_keyed_lock::backend::LeaseSignal)>>;
    let holders: Arc<Holders> = Arc::default();
    let unsignalled = Arc::new(AtomicUsize::new(0));
    let grants = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(AtomicU64::new(0));
    let slowest = Arc::new(Mutex::new(Duration::ZERO));
    let stop = Arc::new(AtomicBool::new(false));
    let wait = Duration::from_millis(500);
    let mut tasks = Vec::new();
    for worker in 0..16 {
        let backend = instances[worker % 2].clone();
        let keys = keys.clone();
        let (holders, unsignalled, grants, failures, slowest, stop) = (
            holders.clone(),
            unsignalled.clone(),
            grants.clone(),
            failures.clone(),
            slowest.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut n = worker;
            while !stop.load(Ordering::SeqCst) {
                n = (n * 7 + 3) % keys.len();
                let name = &keys[n];
                let started = Instant::now();
                let result = backend.acquire("soak", &key(name), wait).await;
                let took = started.elapsed();
                {
                    let mut slowest = slowest.lock().unwrap();
                    *slowest = (*slowest).max(took);
                }
                let lease = match result {
                    Ok(lease) => lease,
                    Err(LockError::Timeout | LockError::Backend(_)) => {
                        failures.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    Err(error) => panic!("{error}"),
                };
                grants.fetch_add(1, Ordering::SeqCst);
                let token = lease.fencing_token().unwrap();
                {
                    let mut holders = holders.lock().unwrap();
                    if let Some((_, signal)) = holders.get(name) {
                        if !signal.is_lost() {
                            unsignalled.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    holders.insert(name.clone(), (token, lease.signal().clone()));
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
                {
                    let mut holders = holders.lock().unwrap();
                    if holders.get(name).is_some_and(|(held, _)| *held == token) {
                        holders.remove(name);
                    }
                }
                lease.release().await;
            }
        }));
    }

    tokio::time::sleep(Duration::from_secs(seconds) / 3).await;
    let before_kill = grants.load(Ordering::SeqCst);
    cluster.nodes[victim].stop();
    let killed = Instant::now();
    // Keys of the killed shard are granted again once its replica took over.
    let recovered = within(
        "the failed shard serves again",
        Duration::from_secs(20),
        async {
            loop {
                // A grant of the victim's key, under the run's own contention, proves the
                // shard is back.
                let attempt = instances[1].acquire("soak", &key(&keys[0]), wait);
                match attempt.await {
                    Ok(lease) => {
                        lease.release().await;
                        break killed.elapsed();
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(seconds) / 3).await;
    // A slot moved to another primary under load, keys and all.
    let moving = instances[0].lock_key("soak", &keys[1]);
    let from = cluster.primary_of(&moving);
    let to = *cluster.primaries().iter().find(|&&p| p != from).unwrap();
    let before_move = grants.load(Ordering::SeqCst);
    cluster.move_slot_of(&moving, to);
    tokio::time::sleep(Duration::from_secs(seconds) / 3).await;
    stop.store(true, Ordering::SeqCst);
    within("the workers stop", Duration::from_secs(10), async {
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await;

    let slowest = *slowest.lock().unwrap();
    println!(
        "cluster primary kill: {} grants ({before_kill} before the kill), {} timeouts or \
         503s, shard back {recovered:?} after the kill, slowest acquire {slowest:?} \
         (wait {wait:?}, command timeout {COMMAND_TIMEOUT:?}), unsignalled overlaps {}",
        grants.load(Ordering::SeqCst),
        failures.load(Ordering::SeqCst),
        unsignalled.load(Ordering::SeqCst),
    );
    assert_eq!(unsignalled.load(Ordering::SeqCst), 0, "unsignalled overlap");
    assert!(
        slowest < wait + COMMAND_TIMEOUT + Duration::from_millis(300),
        "an acquisition took {slowest:?}"
    );
    assert!(
        grants.load(Ordering::SeqCst) > before_move && before_move > before_kill,
        "no grant after the kill or after the slot move"
    );
}

/// Issue 25.3: one primary that may evict keys is enough to lose the locks of its
/// slots, so the policy of every primary is checked when the backend is built.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_evicting_primary_refuses_the_backend() {
    let cluster = RedisCluster::start_primaries();
    let evicting = &cluster.nodes[2];
    let set = cli(
        evicting.port(),
        &["CONFIG", "SET", "maxmemory-policy", "volatile-lru"],
    );
    assert!(set.contains("OK"), "{set}");
    let message = RedisBackend::cluster_builder(cluster.client())
        .command_timeout(COMMAND_TIMEOUT)
        .build()
        .await
        .expect_err("built on a cluster with an evicting primary")
        .to_string();
    let node = format!("127.0.0.1:{}", evicting.port());
    for needed in ["maxmemory-policy", "volatile-lru", "noeviction", &node] {
        assert!(message.contains(needed), "{needed:?} not in: {message}");
    }
    RedisBackend::cluster_builder(cluster.client())
        .command_timeout(COMMAND_TIMEOUT)
        .allow_unsafe_eviction_policy(true)
        .build()
        .await
        .expect("the opt-in builds");
}

/// No node of the cluster listens when the backend is built: the error names Redis
/// Cluster and its nodes (never the password of their URLs), then the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_nodes_at_build_are_named_with_their_addresses_and_cause() {
    // Ports nothing listens on: bound, then closed.
    let nodes: Vec<String> = (0..3)
        .map(|_| {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            format!("127.0.0.1:{port}")
        })
        .collect();
    let urls: Vec<String> = nodes
        .iter()
        .map(|node| format!("redis://locks:s3cret-word@{node}/"))
        .collect();
    let client = redis::cluster::ClusterClientBuilder::new(urls)
        .use_protocol(redis::ProtocolVersion::RESP3)
        .build()
        .unwrap();
    let message = RedisBackend::cluster_builder(client)
        .command_timeout(COMMAND_TIMEOUT)
        .build()
        .await
        .map(|_| ())
        .expect_err("no node listens")
        .to_string();
    eprintln!("unreachable cluster at build: {message}");
    assert!(message.contains("Redis Cluster"), "{message}");
    for node in &nodes {
        assert!(message.contains(node.as_str()), "{node} not in: {message}");
    }
    assert!(
        !message.contains("s3cret"),
        "the password leaked: {message}"
    );
    // The cause follows the nodes.
    let nodes_end = nodes
        .iter()
        .map(|node| message.find(node.as_str()).unwrap() + node.len())
        .max()
        .unwrap();
    assert!(message.len() > nodes_end + 2, "no cause: {message}");
}
