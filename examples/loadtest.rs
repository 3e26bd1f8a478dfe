//! Workload 7 of BENCHMARKS.md: the layer under HTTP load on loopback.
//!
//! ```text
//! cargo run --release --example loadtest                 # 5 alternating repetitions
//! cargo run --release --example loadtest -- --reps 9 --secs 5 --rate 3000
//! cargo run --release --example loadtest -- --quick      # one short repetition (smoke)
//! ```
//!
//! Two servers run as child processes of this example (`loadtest serve plain|keyed`):
//! the same axum app, `POST /orders/{order_id}/pay`, bare and behind
//! `KeyedLockLayer::by_path("order_id")`. The handler answers at once, except for the
//! order `hot`, whose handler takes 1 ms (`tokio::time::sleep`). With `taskset`
//! available and two or more cores, the servers are pinned to core 0 and this driver
//! to core 1; each server runs a one-worker runtime, the driver a current-thread one.
//!
//! Two measurements, each repeated `--reps` times with the variants alternating, and
//! reported as medians:
//!
//! 1. **Throughput on distinct keys** (closed loop): `--conns` requests in flight at
//!    all times for `--secs` seconds, every request on a new key; requests per second,
//!    keyed vs plain (target ≥ 97 %).
//! 2. **Head-of-line isolation** (open model): cold requests on distinct keys arrive at
//!    a fixed rate (`--rate` per second) against the keyed server, with and without a
//!    hot stream (`--hot-rate` per second) on the one key `hot`, which the 1 ms handler
//!    saturates (its excess waits up to 100 ms, at most 64 waiters, else 409/429).
//!    Latency is measured from each request's *intended* send time, not from when it
//!    was actually sent, so a stalled driver or server cannot hide its delay
//!    (coordinated omission); the pacer spins on the clock rather than sleeping on the
//!    1 ms timer wheel. Target: cold p99 with the hot key ≤ 1.10 × without.

use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Path;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tower_keyed_lock::KeyedLockLayer;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve") {
        serve(args.get(1).map_or("plain", String::as_str));
        return;
    }
    let options = Options::parse(&args);
    drive(&options);
}

// ---------------------------------------------------------------------------------------
// The servers.

async fn pay(Path(order_id): Path<String>) -> &'static str {
    if order_id == "hot" {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    "paid"
}

fn app(variant: &str) -> Router {
    let routes = Router::new().route("/orders/{order_id}/pay", post(pay));
    match variant {
        "keyed" => routes.route_layer(
            KeyedLockLayer::by_path("order_id")
                .wait_timeout(Duration::from_millis(100))
                .max_waiters(64),
        ),
        _ => routes,
    }
}

/// The child process: serves until its stdin closes (the driver exited).
fn serve(variant: &str) {
    std::thread::spawn(|| {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
        std::process::exit(0);
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port on 127.0.0.1");
        let addr = listener.local_addr().expect("the bound address");
        println!("LISTENING {addr}");
        std::io::stdout().flush().expect("stdout");
        axum::serve(listener, app(variant)).await.expect("serving");
    });
}

/// A server child process; killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(variant: &str, pinned: bool) -> Self {
        let exe = std::env::current_exe().expect("this example's path");
        let mut command = if pinned {
            let mut command = Command::new("taskset");
            command.args(["-c", "0"]).arg(exe);
            command
        } else {
            Command::new(exe)
        };
        let mut child = command
            .args(["serve", variant])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting a server process");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the server's address");
        let addr = line
            .trim()
            .strip_prefix("LISTENING ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("unexpected server output {line:?}"));
        Server { child, addr }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// The driver.

struct Options {
    reps: usize,
    secs: f64,
    rate: f64,
    hot_rate: f64,
    conns: usize,
}

impl Options {
    fn parse(args: &[String]) -> Self {
        let mut options = Options {
            reps: 5,
            secs: 3.0,
            rate: 2000.0,
            hot_rate: 1000.0,
            conns: 32,
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let mut value = || -> f64 {
                args.next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{arg} needs a number"))
            };
            match arg.as_str() {
                "--reps" => options.reps = value() as usize,
                "--secs" => options.secs = value(),
                "--rate" => options.rate = value(),
                "--hot-rate" => options.hot_rate = value(),
                "--conns" => options.conns = value() as usize,
                "--quick" => {
                    options.reps = 1;
                    options.secs = 0.5;
                }
                other => panic!(
                    "unknown option {other}; see the example's docs \
                     (--reps, --secs, --rate, --hot-rate, --conns, --quick)"
                ),
            }
        }
        options
    }
}

fn drive(options: &Options) {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let pinned = cores >= 2
        && Command::new("taskset")
            .args(["-a", "-p", "-c", "1", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    println!(
        "loadtest: {} repetitions of {} s; {}",
        options.reps,
        options.secs,
        match pinned {
            true => "servers pinned to core 0, driver to core 1",
            false => "not pinned (no taskset or one core)",
        }
    );

    let plain = Server::start("plain", pinned);
    let keyed = Server::start("keyed", pinned);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let secs = Duration::from_secs_f64(options.secs);

    // 1. Throughput, closed loop, distinct keys.
    let (mut plain_rps, mut keyed_rps) = (Vec::new(), Vec::new());
    println!(
        "\n1. throughput, {} requests in flight, distinct keys",
        options.conns
    );
    println!("rep  plain req/s  keyed req/s  keyed/plain");
    for rep in 0..options.reps {
        let run = |server: &Server| {
            rt.block_on(closed_loop(&client, server.addr, options.conns, secs / 5));
            rt.block_on(closed_loop(&client, server.addr, options.conns, secs))
        };
        // Alternate which goes first.
        let (p, k) = if rep % 2 == 0 {
            let p = run(&plain);
            (p, run(&keyed))
        } else {
            let k = run(&keyed);
            (run(&plain), k)
        };
        println!("{rep:>3}  {p:>11.0}  {k:>11.0}  {:>11.3}", k / p);
        plain_rps.push(p);
        keyed_rps.push(k);
    }
    let (p, k) = (median(&mut plain_rps), median(&mut keyed_rps));
    let ratio = k / p;
    println!(
        "median: plain {p:.0} req/s, keyed {k:.0} req/s: keyed/plain = {ratio:.3} \
         (target >= 0.97: {})",
        if ratio >= 0.97 { "met" } else { "missed" }
    );

    // 2. Head-of-line isolation, open model, keyed server.
    println!(
        "\n2. head-of-line isolation: cold keys at {} req/s, hot key at {} req/s \
         (1 ms handler); latency from the intended send time",
        options.rate, options.hot_rate
    );
    println!(
        "rep  without hot: p50 us  p99 us   with hot: p50 us  p99 us  hot 200/409/429/other  p99 ratio"
    );
    let (mut alone_p99, mut shared_p99) = (Vec::new(), Vec::new());
    for rep in 0..options.reps {
        let run = |hot: bool| {
            let hot_rate = if hot { options.hot_rate } else { 0.0 };
            rt.block_on(open_loop(&client, keyed.addr, options.rate, 0.0, secs / 5));
            rt.block_on(open_loop(&client, keyed.addr, options.rate, hot_rate, secs))
        };
        let (mut alone, mut shared) = if rep % 2 == 0 {
            let alone = run(false);
            (alone, run(true))
        } else {
            let shared = run(true);
            (run(false), shared)
        };
        let [a50, a99] = percentiles(&mut alone.cold_us, [0.5, 0.99]);
        let [s50, s99] = percentiles(&mut shared.cold_us, [0.5, 0.99]);
        let h = shared.hot;
        println!(
            "{rep:>3}  {a50:>19} {a99:>7}  {s50:>16} {a99s:>7}  {:>21}  {:>9.3}",
            format!("{}/{}/{}/{}", h[0], h[1], h[2], h[3]),
            s99 as f64 / a99.max(1) as f64,
            a99s = s99
        );
        if alone.cold_errors + shared.cold_errors > 0 {
            println!(
                "     cold requests not answered 200: {} without, {} with the hot key",
                alone.cold_errors, shared.cold_errors
            );
        }
        alone_p99.push(a99 as f64);
        shared_p99.push(s99 as f64);
    }
    let (a, s) = (median(&mut alone_p99), median(&mut shared_p99));
    let ratio = s / a.max(1.0);
    println!(
        "median cold p99: {a:.0} us without the hot key, {s:.0} us with it: {ratio:.3}x \
         (target <= 1.10: {})",
        if ratio <= 1.10 { "met" } else { "missed" }
    );
}

/// Requests per second with `conns` requests in flight, each on a new key.
async fn closed_loop(client: &HttpClient, addr: SocketAddr, conns: usize, time: Duration) -> f64 {
    let start = Instant::now();
    let deadline = start + time;
    let next_key = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..conns {
        let (client, next_key) = (client.clone(), next_key.clone());
        tasks.spawn(async move {
            let mut done = 0u64;
            while Instant::now() < deadline {
                let key = next_key.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                send(&client, addr, &format!("k{key}")).await;
                done += 1;
            }
            done
        });
    }
    let mut done = 0;
    while let Some(count) = tasks.join_next().await {
        done += count.expect("a load task panicked");
    }
    done as f64 / start.elapsed().as_secs_f64()
}

struct OpenLoop {
    /// Latencies of the cold requests, from their intended send time, in µs.
    cold_us: Vec<u64>,
    cold_errors: usize,
    /// Hot-key answers: 200, 409, 429, other.
    hot: [usize; 4],
}

/// Cold requests on distinct keys at `rate` per second and, if `hot_rate` > 0, hot
/// requests on one key, each scheduled at a fixed time; the pacer spins on the clock.
async fn open_loop(
    client: &HttpClient,
    addr: SocketAddr,
    rate: f64,
    hot_rate: f64,
    time: Duration,
) -> OpenLoop {
    let start = Instant::now() + Duration::from_millis(5);
    let end = start + time;
    let mut tasks = JoinSet::new();
    let (mut cold, mut hot) = (0u64, 0u64);
    let at = |i: u64, rate: f64| start + Duration::from_secs_f64(i as f64 / rate);
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        while at(cold, rate) <= now {
            let (client, intended) = (client.clone(), at(cold, rate));
            let key = format!("c{cold}");
            tasks.spawn(async move {
                let status = send(&client, addr, &key).await;
                (false, status, intended.elapsed())
            });
            cold += 1;
        }
        while hot_rate > 0.0 && at(hot, hot_rate) <= now {
            let (client, intended) = (client.clone(), at(hot, hot_rate));
            tasks.spawn(async move {
                let status = send(&client, addr, "hot").await;
                (true, status, intended.elapsed())
            });
            hot += 1;
        }
        // Lets the requests in flight (and the I/O driver) run, then paces again.
        tokio::task::yield_now().await;
    }
    let mut result = OpenLoop {
        cold_us: Vec::with_capacity(cold as usize),
        cold_errors: 0,
        hot: [0; 4],
    };
    while let Some(outcome) = tasks.join_next().await {
        let (is_hot, status, latency) = outcome.expect("a load task panicked");
        if is_hot {
            let slot = match status {
                StatusCode::OK => 0,
                StatusCode::CONFLICT => 1,
                StatusCode::TOO_MANY_REQUESTS => 2,
                _ => 3,
            };
            result.hot[slot] += 1;
        } else {
            result.cold_errors += usize::from(status != StatusCode::OK);
            result.cold_us.push(latency.as_micros() as u64);
        }
    }
    result
}

/// One `POST /orders/{key}/pay`, its body read to the end.
async fn send(client: &HttpClient, addr: SocketAddr, key: &str) -> StatusCode {
    let request = Request::post(format!("http://{addr}/orders/{key}/pay"))
        .body(Empty::new())
        .expect("a valid request");
    match client.request(request).await {
        Ok(response) => {
            let status = response.status();
            match response.into_body().collect().await {
                Ok(_) => status,
                Err(_) => StatusCode::BAD_GATEWAY,
            }
        }
        Err(_) => StatusCode::BAD_GATEWAY,
    }
}

fn percentiles<const N: usize>(samples: &mut [u64], qs: [f64; N]) -> [u64; N] {
    samples.sort_unstable();
    qs.map(|q| match samples.len() {
        0 => 0,
        n => samples[((n - 1) as f64 * q).round() as usize],
    })
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}
