//! Hand-off of a hot key between two instances (release on A → grant on B), Redis and
//! PostgreSQL, on servers the bench starts (issue 33), side by side in one run with
//! what bounds it and what users know:
//!
//! - `backend`: two `RedisBackend`s / `PostgresBackend`s (each its own client, as two
//!   instances), B waiting when A releases; the time from the start of A's release to
//!   B's grant;
//! - the engine's floor, one round trip plus the engine's wake-up, measured with bare
//!   clients after the same idle as the hand-off: Redis, A's `DEL` and `PUBLISH` sent
//!   → the message at B → B's `SET NX PX` answered; PostgreSQL, B blocked in
//!   `pg_advisory_lock` when A's `pg_advisory_unlock` is sent → B's answer
//!   (PostgreSQL's own queue: a round trip and its wake-up in one);
//! - printed beside it, not in the floor: Redis's round trip (`PING`) and wake-up
//!   (`PUBLISH` → message) each timed back to back, and a round trip after the same
//!   idle as the hand-off: what the first exchange after a pause costs on the machine;
//! - polling as madelson's DistributedLock waits on Redis: B tries (`SET NX PX`, or
//!   `pg_try_advisory_lock`) and sleeps a random 10–800 ms (its default busy-wait
//!   range) between tries.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench handoff
//! cargo bench -p tower-keyed-lock-benches --bench handoff -- --test     # CI: a few each
//! HANDOFF_BREAKDOWN=1 cargo bench -p tower-keyed-lock-benches --bench handoff
//! ```
//!
//! `HANDOFF_BREAKDOWN=1` also times PostgreSQL's bare hand-off with B's wait replaced
//! by the backend's statements (see `pg_breakdown`).
//!
//! Prints p50/p90 of each, and `backend p50 / floor p50` (target ≤ 1.5×); a full run
//! also writes them to `<criterion>/tkl-custom/handoff.jsonl` for `scripts/bench-charts`.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use support::engine::{hand_off, postgres_instances, redis_instances};
use support::{pg_server, redis_server};
use tokio::runtime::Runtime;

/// How long B waits before each release: long enough to be queued or subscribed.
const SETTLE: Duration = Duration::from_millis(20);
/// madelson's default busy-wait sleep range on Redis.
const POLL_MIN: Duration = Duration::from_millis(10);
const POLL_MAX: Duration = Duration::from_millis(800);

fn main() {
    let quick = std::env::args().any(|arg| arg == "--test");
    let (rounds, polled) = if quick { (3, 2) } else { (201, 41) };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let lines = [redis(&rt, rounds, polled), postgres(&rt, rounds, polled)].concat();
    support::write_results("handoff", quick, &lines);
}

fn redis(rt: &Runtime, rounds: usize, polled: usize) -> Vec<String> {
    let server = redis_server::RedisServer::start();
    let (a, b) = rt.block_on(redis_instances(&server));
    let ours = rt.block_on(hand_off(a, b, rounds, SETTLE));
    let floor = rt.block_on(redis_bare_hand_offs(&server, rounds));
    let round_trip = rt.block_on(redis_round_trips(&server, rounds, Duration::ZERO));
    let wake = rt.block_on(redis_wake_ups(&server, rounds));
    let idle = rt.block_on(redis_round_trips(&server, rounds, SETTLE));
    let polling = rt.block_on(redis_polling(&server, polled));
    let lines = report("redis", &ours, &[floor], &polling);
    let ms = |times: &[Duration]| times[times.len() / 2].as_secs_f64() * 1e3;
    println!(
        "  redis, its parts back to back: round trip p50 {:.3} ms + wake-up p50 {:.3} ms = \
         {:.3} ms (backend / that {:.2}x); a round trip after the hand-off's idle \
         ({SETTLE:?}): p50 {:.3} ms",
        ms(&round_trip),
        ms(&wake),
        ms(&round_trip) + ms(&wake),
        ms(&ours) / (ms(&round_trip) + ms(&wake)),
        ms(&idle),
    );
    lines
}

fn postgres(rt: &Runtime, rounds: usize, polled: usize) -> Vec<String> {
    let server = pg_server::PgServer::start();
    let (a, b) = postgres_instances(&server);
    let ours = rt.block_on(hand_off(a, b, rounds, SETTLE));
    let floor = rt.block_on(pg_bare_hand_offs(&server, rounds, bare_wait));
    let polling = rt.block_on(pg_polling(&server, polled));
    if std::env::var_os("HANDOFF_BREAKDOWN").is_some() {
        rt.block_on(pg_breakdown(&server, rounds));
    }
    report("postgres", &ours, &[floor], &polling)
}

/// Where the backend's PostgreSQL hand-off goes beyond the floor (`HANDOFF_BREAKDOWN=1`):
/// the bare hand-off with B's wait replaced by the backend's statements, as they were
/// and as they are (copied here: the token, the marker and the holder record after
/// the grant).
async fn pg_breakdown(server: &pg_server::PgServer, rounds: usize) {
    const GRANTED: &str = "(SELECT token FROM (SELECT token, \
        set_config('tower_keyed_lock.lease', '33/0123456789abcdef', false), \
        set_config('application_name', left('tkl ' || (extract(epoch from clock_timestamp()) \
          * 1000)::bigint || ' ' || coalesce(token::text, '-') || ' ' || 'bench', 63), false) \
        FROM (SELECT nextval('tower_keyed_lock_fencing') AS token) AS issued) AS granted)";
    const TIMEOUT: &str = "SELECT set_config('lock_timeout', '10000ms', true)";
    type Wait = fn(i32) -> String;
    let waits: [(&str, Wait); 4] = [
        ("bare", bare_wait),
        ("lock_timeout set first", |_| {
            format!("{TIMEOUT}; SELECT pg_advisory_lock(33)")
        }),
        ("the grant in a statement after the lock (before)", |pid| {
            format!(
                "{TIMEOUT}; SELECT pg_advisory_lock(33) WHERE pg_backend_pid() = {pid}; \
                 SELECT pg_backend_pid(), true, {GRANTED} WHERE pg_backend_pid() = {pid}"
            )
        }),
        ("the grant in the locking statement (now)", |pid| {
            format!(
                "{TIMEOUT}; SELECT pg_backend_pid(), true, {GRANTED} \
                 FROM (SELECT pg_advisory_lock(33) WHERE pg_backend_pid() = {pid}) AS waited"
            )
        }),
    ];
    for (name, wait) in waits {
        let times = pg_bare_hand_offs(server, rounds, wait).await;
        let ms =
            |q: f64| times[((times.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
        println!(
            "hand-off postgres, B's wait {name}: p50 {:.3} ms p90 {:.3} ms",
            ms(0.5),
            ms(0.9)
        );
    }
}

/// Prints the medians and the target ratio (`floor` parts are summed by median); the
/// same as JSON lines, one per series.
fn report(
    engine: &str,
    ours: &[Duration],
    floor: &[Vec<Duration>],
    polling: &[Duration],
) -> Vec<String> {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let at = |times: &[Duration], q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    let floor_p50: Duration = floor.iter().map(|part| at(part, 0.5)).sum();
    let parts: Vec<String> = floor
        .iter()
        .map(|part| format!("{:.3}", ms(at(part, 0.5))))
        .collect();
    println!(
        "hand-off {engine}: backend p50 {:.3} ms p90 {:.3} ms ({} hand-offs); floor {:.3} ms \
         (p50s {}); backend/floor {:.2}x; polling 10-800 ms p50 {:.1} ms p90 {:.1} ms ({} \
         hand-offs); polling/backend {:.0}x",
        ms(at(ours, 0.5)),
        ms(at(ours, 0.9)),
        ours.len(),
        ms(floor_p50),
        parts.join(" + "),
        at(ours, 0.5).as_secs_f64() / floor_p50.as_secs_f64(),
        ms(at(polling, 0.5)),
        ms(at(polling, 0.9)),
        polling.len(),
        at(polling, 0.5).as_secs_f64() / at(ours, 0.5).as_secs_f64(),
    );
    let floor_p90: Duration = floor.iter().map(|part| at(part, 0.9)).sum();
    let line = |series: &str, p50: Duration, p90: Duration| {
        format!(
            r#"{{"workload":"backend-handoff","engine":"{engine}","series":"{series}","p50_ns":{},"p90_ns":{}}}"#,
            p50.as_nanos(),
            p90.as_nanos()
        )
    };
    vec![
        line("backend", at(ours, 0.5), at(ours, 0.9)),
        line("floor", floor_p50, floor_p90),
        line("polling", at(polling, 0.5), at(polling, 0.9)),
    ]
}

/// Sorted, for quantiles.
fn sorted(mut times: Vec<Duration>) -> Vec<Duration> {
    times.sort();
    times
}

/// A pause in `POLL_MIN..POLL_MAX`, from a xorshift seeded by the clock: spread, not
/// secret.
fn poll_pause(state: &mut u64) -> Duration {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let span = (POLL_MAX - POLL_MIN).as_micros() as u64;
    POLL_MIN + Duration::from_micros(*state % span)
}

fn seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    (nanos as u64) | 1
}

async fn redis_connection(server: &redis_server::RedisServer) -> redis::aio::MultiplexedConnection {
    server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// `PING` round trips on a bare connection, each after `idle` (`SETTLE`, as a
/// hand-off's release comes, is not part of the floor: it shows what a first exchange
/// after a pause costs on this machine, where a loaded or virtual one wakes a sleeping
/// process late).
async fn redis_round_trips(
    server: &redis_server::RedisServer,
    rounds: usize,
    idle: Duration,
) -> Vec<Duration> {
    let mut connection = redis_connection(server).await;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        if !idle.is_zero() {
            tokio::time::sleep(idle).await;
        }
        let sent = Instant::now();
        redis::cmd("PING")
            .query_async::<()>(&mut connection)
            .await
            .unwrap();
        times.push(sent.elapsed());
    }
    sorted(times)
}

/// `PUBLISH` sent on one bare connection → the message at a subscribed one (RESP3
/// push messages, as the backend's release subscription gets them).
async fn redis_wake_ups(server: &redis_server::RedisServer, rounds: usize) -> Vec<Duration> {
    let (_subscriber, mut messages) = redis_subscriber(server, "bench-wake").await;
    let mut publisher = redis_connection(server).await;
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        // Drains the subscription confirmation and anything late.
        while messages.try_recv().is_ok() {}
        let sent = Instant::now();
        let mut command = redis::cmd("PUBLISH");
        let publish = command
            .arg("bench-wake")
            .arg("released")
            .query_async::<i64>(&mut publisher);
        let (delivered, received) = tokio::join!(publish, async {
            next_message(&mut messages).await;
            Instant::now()
        });
        assert_eq!(delivered.unwrap(), 1, "one subscriber");
        times.push(received - sent);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    sorted(times)
}

/// The floor, as PostgreSQL's: the engine's own wake-up plus one round trip, with bare
/// clients after the hand-off's idle. B, subscribed on a RESP3 connection, waits for a
/// message; A deletes the key and publishes in one round trip (a pipeline); B, woken,
/// sends `SET NX PX` on its connection. Timed from A's send to B's answer.
async fn redis_bare_hand_offs(server: &redis_server::RedisServer, rounds: usize) -> Vec<Duration> {
    let (b, mut messages) = redis_subscriber(server, "bench-bare").await;
    let mut a = redis_connection(server).await;
    let set = |token: &'static str| {
        let mut command = redis::cmd("SET");
        command
            .arg("bench-bare")
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(30_000);
        command
    };
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        assert!(set("a")
            .query_async::<Option<String>>(&mut a)
            .await
            .unwrap()
            .is_some());
        // Drains the subscription confirmation and anything late.
        while messages.try_recv().is_ok() {}
        let waiter = {
            let mut b = b.clone();
            async move {
                next_message(&mut messages).await;
                let granted = set("b")
                    .query_async::<Option<String>>(&mut b)
                    .await
                    .unwrap();
                assert!(granted.is_some(), "b takes the released key");
                (messages, Instant::now())
            }
        };
        let waiter = tokio::spawn(waiter);
        tokio::time::sleep(SETTLE).await;
        let released = Instant::now();
        redis::pipe()
            .del("bench-bare")
            .ignore()
            .publish("bench-bare", "released")
            .ignore()
            .query_async::<()>(&mut a)
            .await
            .unwrap();
        let (returned, granted) = waiter.await.unwrap();
        messages = returned;
        times.push(granted - released);
        redis::cmd("DEL")
            .arg("bench-bare")
            .query_async::<()>(&mut a)
            .await
            .unwrap();
    }
    sorted(times)
}

/// A RESP3 connection subscribed to `channel`, and its push messages.
async fn redis_subscriber(
    server: &redis_server::RedisServer,
    channel: &str,
) -> (
    redis::aio::MultiplexedConnection,
    tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>,
) {
    let (sender, messages) = tokio::sync::mpsc::unbounded_channel();
    let config = redis::AsyncConnectionConfig::new().set_push_sender(sender);
    let url = format!("redis://127.0.0.1:{}/?protocol=resp3", server.port());
    let client = redis::Client::open(url).unwrap();
    let mut connection = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    connection.subscribe(channel).await.unwrap();
    (connection, messages)
}

/// Waits for the next published message (past subscription confirmations).
async fn next_message(messages: &mut tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>) {
    loop {
        let push = messages.recv().await.expect("the subscription stays up");
        if push.kind == redis::PushKind::Message {
            return;
        }
    }
}

/// B polls `SET NX PX` with 10–800 ms sleeps while A holds, then A deletes the key.
async fn redis_polling(server: &redis_server::RedisServer, rounds: usize) -> Vec<Duration> {
    let mut a = redis_connection(server).await;
    let b = redis_connection(server).await;
    let mut rng = seed();
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let set = |mut connection: redis::aio::MultiplexedConnection, token: &'static str| async move {
            redis::cmd("SET")
                .arg("bench-poll")
                .arg(token)
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async::<Option<String>>(&mut connection)
                .await
                .unwrap()
                .is_some()
        };
        assert!(set(a.clone(), "a").await);
        let seed = poll_pause(&mut rng).as_nanos() as u64 | 1;
        let waiter = tokio::spawn({
            let b = b.clone();
            async move {
                let mut rng = seed;
                while !set(b.clone(), "b").await {
                    tokio::time::sleep(poll_pause(&mut rng)).await;
                }
                Instant::now()
            }
        });
        tokio::time::sleep(SETTLE).await;
        let released = Instant::now();
        redis::cmd("DEL")
            .arg("bench-poll")
            .query_async::<()>(&mut a)
            .await
            .unwrap();
        let granted = waiter.await.unwrap();
        times.push(granted - released);
        redis::cmd("DEL")
            .arg("bench-poll")
            .query_async::<()>(&mut a)
            .await
            .unwrap();
    }
    sorted(times)
}

async fn pg_client(server: &pg_server::PgServer) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&server.conn_str(), tokio_postgres::NoTls)
        .await
        .expect("PostgreSQL accepts a connection");
    tokio::spawn(connection);
    client
}

/// The floor's wait: PostgreSQL's own queue, nothing else.
fn bare_wait(_pid: i32) -> String {
    "SELECT pg_advisory_lock(33)".to_owned()
}

/// B blocked in `wait(B's pid)` (the floor: [`bare_wait`]) on a bare session
/// when A's `pg_advisory_unlock` is sent → B's answer.
async fn pg_bare_hand_offs(
    server: &pg_server::PgServer,
    rounds: usize,
    wait: fn(i32) -> String,
) -> Vec<Duration> {
    let a = pg_client(server).await;
    let b = Arc::new(pg_client(server).await);
    let pid: i32 = b
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let wait = wait(pid);
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        a.simple_query("SELECT pg_advisory_lock(33)").await.unwrap();
        let waiter = tokio::spawn({
            let (b, wait) = (Arc::clone(&b), wait.clone());
            async move {
                b.simple_query(&wait).await.unwrap();
                let granted = Instant::now();
                b.simple_query("SELECT pg_advisory_unlock(33)")
                    .await
                    .unwrap();
                granted
            }
        });
        tokio::time::sleep(SETTLE).await;
        let released = Instant::now();
        a.simple_query("SELECT pg_advisory_unlock(33)")
            .await
            .unwrap();
        times.push(waiter.await.unwrap() - released);
    }
    sorted(times)
}

/// B polls `pg_try_advisory_lock` with 10–800 ms sleeps while A holds.
async fn pg_polling(server: &pg_server::PgServer, rounds: usize) -> Vec<Duration> {
    let a = pg_client(server).await;
    let b = Arc::new(pg_client(server).await);
    let mut rng = seed();
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        a.simple_query("SELECT pg_advisory_lock(34)").await.unwrap();
        let seed = poll_pause(&mut rng).as_nanos() as u64 | 1;
        let waiter = tokio::spawn({
            let b = Arc::clone(&b);
            async move {
                let mut rng = seed;
                loop {
                    let row = b
                        .query_one("SELECT pg_try_advisory_lock(34)", &[])
                        .await
                        .unwrap();
                    if row.get::<_, bool>(0) {
                        break;
                    }
                    tokio::time::sleep(poll_pause(&mut rng)).await;
                }
                let granted = Instant::now();
                b.simple_query("SELECT pg_advisory_unlock(34)")
                    .await
                    .unwrap();
                granted
            }
        });
        tokio::time::sleep(SETTLE).await;
        let released = Instant::now();
        a.simple_query("SELECT pg_advisory_unlock(34)")
            .await
            .unwrap();
        times.push(waiter.await.unwrap() - released);
    }
    sorted(times)
}
