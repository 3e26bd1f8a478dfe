//! Leader election: three candidates, one leader at a time, `LeaderElection`.
//!
//! Three candidates, each with its own backend client (so, to the engine, three
//! instances), campaign for the key `leader`. The first is elected; the others wait.
//! `leader()` names the leader (its instance id, since when, its fencing token). The
//! leader steps down and a waiting candidate is elected, with a higher fencing token;
//! that one drops its leadership (which steps down too) and the last is elected. Then
//! the last runs as leader with `run_as_leader` and steps down when its work ends.
//!
//! Run it with `cargo run --features redis --example leader_election`. It starts its own
//! `redis-server` on a free port (and stops it at the end); without `redis-server`, or
//! without the `redis` feature, it says so and the candidates share the in-process lock
//! instead (then there are no fencing tokens, and `leader()` names this process). It
//! checks what it shows and exits non-zero otherwise: never two leaders, every hand-over
//! to a candidate that was waiting, `leader()` naming the leader of the moment, and
//! fencing tokens that grow from leader to leader.

use std::time::Duration;

use tower_keyed_lock::{DistributedLocks, LeaderElection, Leadership, LockError};

const KEY: &str = "leader";
const NAMES: [&str; 3] = ["candidate-1", "candidate-2", "candidate-3"];

#[cfg(feature = "redis")]
#[path = "../tests/support/ports.rs"]
mod ports;
#[cfg(feature = "redis")]
#[path = "../tests/support/process.rs"]
mod process;
#[cfg(feature = "redis")]
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

#[tokio::main]
async fn main() {
    let engine = Engine::start();
    let elections = {
        let mut elections = Vec::new();
        for name in NAMES {
            elections.push(LeaderElection::new(engine.locks(name).await, KEY));
        }
        elections
    };
    let observer = LeaderElection::new(engine.locks("observer").await, KEY);
    assert_eq!(
        observer.leader().await.unwrap(),
        None,
        "a leader before any campaign"
    );

    // 1. The first candidate is elected; the others campaign and wait.
    let first = elections[0].campaign().await.unwrap();
    println!(
        "{} is elected (fencing token {:?})",
        NAMES[0],
        first.fencing_token()
    );
    engine.check_leader(&observer, NAMES[0], &first).await;
    assert!(matches!(
        elections[1].try_campaign().await,
        Err(LockError::Busy)
    ));
    let mut waiting = Vec::new();
    for (i, election) in elections.iter().enumerate().skip(1) {
        let election = election.clone();
        waiting.push(tokio::spawn(async move {
            (i, election.campaign().await.unwrap())
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        waiting.iter().all(|w| !w.is_finished()),
        "two leaders at once"
    );
    println!("{} and {} wait", NAMES[1], NAMES[2]);

    // 2. The leader steps down: one waiting candidate is elected, the other waits on.
    let token = first.fencing_token();
    first.step_down().await;
    println!("{} steps down", NAMES[0]);
    let (second_no, second) = next_leader(&mut waiting).await;
    println!(
        "{} is elected (fencing token {:?})",
        NAMES[second_no],
        second.fencing_token()
    );
    assert_grows(token, second.fencing_token());
    engine
        .check_leader(&observer, NAMES[second_no], &second)
        .await;

    // 3. Dropping a leadership steps down too: the last candidate is elected.
    let token = second.fencing_token();
    drop(second);
    println!("{} drops its leadership", NAMES[second_no]);
    let (third_no, third) = next_leader(&mut waiting).await;
    println!(
        "{} is elected (fencing token {:?})",
        NAMES[third_no],
        third.fencing_token()
    );
    assert_grows(token, third.fencing_token());
    engine
        .check_leader(&observer, NAMES[third_no], &third)
        .await;
    third.step_down().await;

    // 4. `run_as_leader`: campaign, work as leader, step down when the work ends.
    let outcome = elections[0]
        .run_as_leader(|info| async move {
            println!(
                "{} leads again (fencing token {:?})",
                NAMES[0],
                info.fencing_token()
            );
            "the report is sent"
        })
        .await
        .unwrap()
        .expect("the leadership held while it worked");
    println!("{}: {outcome}; it stepped down", NAMES[0]);
    assert_eq!(
        observer.leader().await.unwrap(),
        None,
        "a leader after every step-down"
    );
    println!("no leader now");
}

/// The waiting candidate elected next: exactly one of those still waiting.
async fn next_leader(
    waiting: &mut Vec<tokio::task::JoinHandle<(usize, Leadership)>>,
) -> (usize, Leadership) {
    let (elected, _, rest) = futures_select_all(std::mem::take(waiting)).await;
    *waiting = rest;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        waiting.iter().all(|w| !w.is_finished()),
        "two leaders at once"
    );
    elected
}

/// The first of `tasks` to finish, its index, and the others (still running).
async fn futures_select_all<T>(
    tasks: Vec<tokio::task::JoinHandle<T>>,
) -> (T, usize, Vec<tokio::task::JoinHandle<T>>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(index) = tasks.iter().position(|task| task.is_finished()) {
            let mut tasks = tasks;
            let done = tasks.remove(index);
            return (done.await.unwrap(), index, tasks);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no candidate was elected"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn assert_grows(before: Option<u64>, after: Option<u64>) {
    if let (Some(before), Some(after)) = (before, after) {
        assert!(
            after > before,
            "the new leader's token {after} is not above {before}"
        );
    }
}

/// Where the candidates meet.
enum Engine {
    #[cfg(feature = "redis")]
    Redis(redis_server::RedisServer),
    InProcess(DistributedLocks),
}

impl Engine {
    fn start() -> Engine {
        #[cfg(feature = "redis")]
        {
            let installed = std::process::Command::new("redis-server")
                .arg("--version")
                .output()
                .is_ok();
            if installed {
                let server = redis_server::RedisServer::start();
                println!("redis-server started on port {}", server.port());
                return Engine::Redis(server);
            }
            println!("redis-server is not installed: the candidates share the in-process lock");
        }
        #[cfg(not(feature = "redis"))]
        println!("built without the `redis` feature: the candidates share the in-process lock");
        Engine::InProcess(DistributedLocks::in_process("scheduler"))
    }

    /// The locks of one candidate: its own client, recording `name` as instance id.
    async fn locks(&self, name: &str) -> DistributedLocks {
        match self {
            #[cfg(feature = "redis")]
            Engine::Redis(server) => {
                let backend = tower_keyed_lock::RedisBackend::builder(server.client())
                    .instance_id(name)
                    .lease(Duration::from_millis(1500))
                    // A server started just now: no instance can hold a key it lost.
                    .restart_guard(false)
                    .build()
                    .await
                    .expect("the example's redis-server answers");
                DistributedLocks::new("scheduler", backend)
            }
            Engine::InProcess(locks) => {
                let _ = name;
                locks.clone()
            }
        }
    }

    /// `leader()` names `name` (in process: this process) with the leadership's token.
    async fn check_leader(&self, observer: &LeaderElection, name: &str, leadership: &Leadership) {
        let leader = observer.leader().await.unwrap().expect("a leader");
        println!("  leader(): {leader}");
        let expected = match self {
            #[cfg(feature = "redis")]
            Engine::Redis(_) => name.to_owned(),
            Engine::InProcess(_) => {
                let _ = name;
                tower_keyed_lock::backend::default_instance_id()
            }
        };
        assert_eq!(leader.instance(), Some(expected.as_str()));
        assert_eq!(leader.fencing_token(), leadership.fencing_token());
    }
}
