//! The Redlock backend against five real `redis-server` masters the bench starts on
//! free ports, beside the single-Redis backend on one of them.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench redlock
//! cargo bench -p tower-keyed-lock-benches --bench redlock -- --test     # CI: each once
//! ```
//!
//! 1. Uncontended acquire + release of one key: `RedlockBackend` (`acquire` then
//!    `Lease::release`: the acquire script on five masters at once, done at the third
//!    grant; compare-and-delete on all five, done when all answered) against the bare
//!    protocol sent the same way: the bare safe pair (`support::redis_pair`: `SET key
//!    token NX PX`, then a compare-and-delete script) with the five masters at once
//!    through one `ConnectionManager` each, done at the third OK, then the
//!    compare-and-delete on all five, done when all answered. Criterion times each;
//!    then both run in alternating batches (A B, B A, …) and the median ratio is
//!    printed. The same for `RedisBackend` against the bare safe pair on one master.
//! 2. Hand-off between two instances: instance A holds the key, instance B waits for
//!    it, A releases; the time from the start of A's release to B's grant. Redlock
//!    polls (jittered, 5 ms doubling to the poll interval, cut to the holder's TTL);
//!    Redis wakes B with a release message.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::engine::{alternating, hand_off, report_hand_off, EngineBench};

use support::redis_pair::{fresh_token, SafePair};
use support::redis_server::RedisServer;
use tokio::task::JoinSet;
use tower_keyed_lock::backend::redlock::RedlockBackend;
use tower_keyed_lock::{Key, LockBackend, RedisBackend};

const MASTERS: usize = 5;

/// Long enough for the waiter to be waiting (polling, or subscribed) before the release.
const SETTLE: Duration = Duration::from_millis(50);

fn main() {
    let EngineBench {
        criterion: mut c,
        quick,
        rt,
    } = EngineBench::new();
    let masters: Vec<RedisServer> = (0..MASTERS).map(|_| RedisServer::start()).collect();
    let urls: Vec<String> = masters.iter().map(RedisServer::url).collect();
    let redlock = rt.block_on(redlock_backend(&urls));
    let redis = rt.block_on(redis_backend(&masters[0]));
    let bare: Vec<SafePair> = rt.block_on(async {
        let mut pairs = Vec::new();
        for master in &masters {
            pairs.push(SafePair::new(&master.client()).await);
        }
        pairs
    });
    let key = Key::new("order-1", 256).unwrap();
    // Loads the scripts (the first call of each is NOSCRIPT + SCRIPT LOAD).
    rt.block_on(backend_round(&redlock, &key));
    rt.block_on(backend_round(&redis, &key));

    let mut group = c.benchmark_group("redlock-uncontended");
    group.bench_function("redlock-acquire-release", |b| {
        b.to_async(&rt).iter(|| backend_round(&redlock, &key));
    });
    group.bench_function("bare-5-masters-safe-pair", |b| {
        b.to_async(&rt).iter(|| bare_round(&bare));
    });
    group.bench_function("redis-acquire-release", |b| {
        b.to_async(&rt).iter(|| backend_round(&redis, &key));
    });
    group.bench_function("bare-1-master-safe-pair", |b| {
        b.to_async(&rt).iter(|| bare_round(&bare[..1]));
    });
    group.finish();

    let (rounds, batch) = if quick { (2, 5) } else { (21, 200) };
    let redlock_vs_bare = rt.block_on(alternating(
        || backend_round(&redlock, &key),
        || bare_round(&bare),
        rounds,
        batch,
    ));
    redlock_vs_bare.print("redlock, 5 masters", "bare safe pair on 5 masters");
    let redis_vs_bare = rt.block_on(alternating(
        || backend_round(&redis, &key),
        || bare_round(&bare[..1]),
        rounds,
        batch,
    ));
    redis_vs_bare.print("redis, 1 server", "bare safe pair on 1 server");
    let redlock_vs_redis = rt.block_on(alternating(
        || backend_round(&redlock, &key),
        || backend_round(&redis, &key),
        rounds,
        batch,
    ));
    redlock_vs_redis.print("redlock, 5 masters", "redis, 1 server");

    let handoffs = if quick { 3 } else { 50 };
    let (a, b) = rt.block_on(async {
        let a: Arc<dyn LockBackend> = Arc::new(redlock_backend(&urls).await);
        let b: Arc<dyn LockBackend> = Arc::new(redlock_backend(&urls).await);
        (a, b)
    });
    report_hand_off(
        "redlock, 5 masters",
        &rt.block_on(hand_off(a, b, handoffs, SETTLE)),
    );
    let (a, b) = rt.block_on(async {
        let a: Arc<dyn LockBackend> = Arc::new(redis_backend(&masters[1]).await);
        let b: Arc<dyn LockBackend> = Arc::new(redis_backend(&masters[1]).await);
        (a, b)
    });
    report_hand_off(
        "redis, 1 server",
        &rt.block_on(hand_off(a, b, handoffs, SETTLE)),
    );
    c.final_summary();
}

/// Redlock as deployed, bar the restart guard (the masters just started): defaults
/// otherwise (30 s lease, 100 ms command timeout, 200 ms poll interval).
async fn redlock_backend(urls: &[String]) -> RedlockBackend {
    RedlockBackend::builder(urls.to_vec())
        .restart_guard(false)
        .build()
        .await
        .expect("the backend reaches the masters")
}

async fn redis_backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::builder(server.client())
        .restart_guard(false)
        .build()
        .await
        .expect("the backend connects to Redis")
}

async fn backend_round(backend: &impl LockBackend, key: &Key) {
    let lease = backend
        .acquire("bench", key, Duration::from_secs(1))
        .await
        .expect("an uncontended key");
    lease.release().await;
}

/// The bare protocol, sent as the backend sends it: `SET NX PX` to every master at
/// once, done at a majority of OKs (the rest run on); then the compare-and-delete to
/// every master at once, each after its master's `SET` answered (sent before, it could
/// find nothing and the late `SET` hold the key for a lease), done when all answered.
/// One master: the bare safe pair.
async fn bare_round(masters: &[SafePair]) {
    const LOCK: &str = "bare:order-1";
    let majority = masters.len() / 2 + 1;
    let token = fresh_token();
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let (release, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut masters_done = JoinSet::new();
    for pair in masters {
        let (pair, token, answers) = (pair.clone(), token.clone(), answers.clone());
        let mut released = release.subscribe();
        masters_done.spawn(async move {
            let _ = answers.send(pair.set(LOCK, &token).await);
            let _ = released.recv().await;
            pair.delete(LOCK, &token).await;
        });
    }
    let mut granted = 0;
    for _ in masters {
        granted += usize::from(answered.recv().await.unwrap());
        if granted >= majority {
            break;
        }
    }
    assert!(granted >= majority, "the bare key was held");
    release.send(()).unwrap();
    while let Some(done) = masters_done.join_next().await {
        done.unwrap();
    }
}
