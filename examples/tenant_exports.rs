//! At most 3 exports per tenant at once, across all instances: `permits(3)` with a
//! Redis backend.
//!
//! Three "instances" — each a `DistributedLocks` with its own Redis connections —
//! start 5 exports each for tenant `acme` and 2 for tenant `globex`, all at once. Every
//! export holds one of its tenant's 3 permits, cluster-wide, for 150 ms. The example
//! counts the exports running at once per tenant, over all instances, and checks what
//! it prints: never more than 3 for a tenant, 3 at once at some point for `acme`
//! (the permits are used, not one at a time), `globex` never waiting behind `acme`,
//! and every export done.
//!
//! Run it with `cargo run --features redis --example tenant_exports`. It starts its own
//! `redis-server` on a free port (and stops it at the end); `./scripts/test` installs
//! `redis-server` when it is missing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tower_keyed_lock::{DistributedLocks, RedisBackend};

/// Exports of one tenant allowed at once, across all instances.
const PERMITS: usize = 3;
const INSTANCES: usize = 3;
/// How long one export runs.
const EXPORT: Duration = Duration::from_millis(150);

/// Exports running now, and the most seen at once, per tenant (over all instances).
#[derive(Default)]
struct Running {
    now: HashMap<&'static str, usize>,
    most: HashMap<&'static str, usize>,
    done: HashMap<&'static str, usize>,
}

// The test suite's launcher (started on a free port, stopped on drop).
#[path = "../tests/support/ports.rs"]
mod ports;
#[path = "../tests/support/process.rs"]
mod process;
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

#[tokio::main]
async fn main() {
    // A redis-server of the example's own on a free port (`scripts/test` installs it).
    let redis = redis_server::RedisServer::start();
    println!("redis-server started on port {}", redis.port());

    let mut instances = Vec::new();
    for _ in 0..INSTANCES {
        let client = redis.client();
        let backend = RedisBackend::builder(client)
            .lease(Duration::from_secs(2))
            // A Redis this example just started, empty: nothing to guard after a restart.
            .restart_guard(false)
            .build()
            .await
            .expect("redis answers");
        let exports = DistributedLocks::builder("exports")
            .backend(backend)
            .permits(PERMITS)
            .build();
        instances.push(exports);
    }

    let running = Arc::new(Mutex::new(Running::default()));
    let mut tasks = Vec::new();
    for (instance, exports) in instances.iter().enumerate() {
        for (tenant, count) in [("acme", 5), ("globex", 2)] {
            for _ in 0..count {
                let (exports, running) = (exports.clone(), running.clone());
                tasks.push(tokio::spawn(async move {
                    // One of the tenant's 3 permits, wherever the other exports run.
                    let permit = exports.lock(tenant).await.expect("a permit");
                    {
                        let mut running = running.lock().unwrap();
                        let now = running.now.entry(tenant).or_default();
                        *now += 1;
                        let now = *now;
                        let most = running.most.entry(tenant).or_default();
                        *most = (*most).max(now);
                    }
                    let token = permit.fencing_token();
                    tokio::time::sleep(EXPORT).await;
                    {
                        let mut running = running.lock().unwrap();
                        *running.now.get_mut(tenant).unwrap() -= 1;
                        *running.done.entry(tenant).or_default() += 1;
                    }
                    permit.release().await;
                    println!(
                        "instance {instance}: export of {tenant} done (permit token {token:?})"
                    );
                }));
            }
        }
    }
    for task in tasks {
        task.await.expect("an export panicked");
    }

    let running = running.lock().unwrap();
    for (tenant, count) in [("acme", 5), ("globex", 2)] {
        let most = running.most[tenant];
        let done = running.done[tenant];
        println!(
            "{tenant}: {done} exports done on {INSTANCES} instances, at most {most} at once \
             (limit {PERMITS})"
        );
        assert!(most <= PERMITS, "{tenant}: {most} exports ran at once");
        assert_eq!(done, count * INSTANCES, "{tenant}: an export was lost");
    }
    assert_eq!(
        running.most["acme"], PERMITS,
        "acme's 15 exports never used all 3 permits at once"
    );
    assert_eq!(running.most["globex"], PERMITS, "globex waited behind acme");
}
