//! The layer's Prometheus metrics under load.
//!
//! An "orders" app — `POST /orders/{order_id}/pay` behind
//! `KeyedLockLayer::by_path("order_id").name("orders")` with a short wait timeout and
//! a small waiter queue — plus `GET /metrics`, which renders a
//! `metrics-exporter-prometheus` recorder. A load driver in the same process sends a
//! few hundred overlapping requests over a handful of order ids, one of them hot, so
//! requests wait, some are turned away (409 after the wait timeout, 429 when the queue
//! is full) and the histograms fill. Histograms are exported with buckets from 0.5 ms to
//! 10 s, so Prometheus gets `_bucket` series for `histogram_quantile` (and the dashboard
//! in `dashboards/keyed-lock.json`).
//!
//! ```text
//! cargo run --example metrics               # one burst, print keyed_lock_* lines, check them, exit
//! cargo run --example metrics -- --serve    # serve on 127.0.0.1:3000 (or $PORT), load every second
//! ```
//!
//! The default run doubles as a smoke test: it exits non-zero if a series is missing or
//! the counters disagree with the statuses the client saw. With `--serve`, point
//! Prometheus at it:
//!
//! ```yaml
//! # prometheus.yml
//! scrape_configs:
//!   - job_name: keyed-lock-example
//!     scrape_interval: 5s
//!     static_configs:
//!       - targets: ["127.0.0.1:3000"]   # metrics_path defaults to /metrics
//! ```
//!
//! The recorder is installed before the router is built: the layer registers its
//! metric handles on its first request, against whatever recorder is global then.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::task::JoinSet;
use tower_keyed_lock::KeyedLockLayer;

/// How long one payment holds its order.
const WORK: Duration = Duration::from_millis(4);
/// How long a payment waits for its order before it gets 409.
const WAIT_TIMEOUT: Duration = Duration::from_millis(10);
/// Payments allowed to wait per order; one more gets 429 at once.
const MAX_WAITERS: usize = 5;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

async fn pay() -> &'static str {
    tokio::time::sleep(WORK).await;
    "paid"
}

async fn metrics(State(handle): State<PrometheusHandle>) -> String {
    handle.render()
}

#[tokio::main]
async fn main() {
    let serve_forever = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--serve") => true,
        Some(other) => {
            eprintln!("unknown argument {other:?}; usage: metrics [--serve]");
            std::process::exit(2);
        }
    };

    // First the recorder, then the router.
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Prefix("keyed_lock_".into()),
            tower_keyed_lock::metrics::HISTOGRAM_BUCKETS,
        )
        .expect("buckets are not empty")
        .install_recorder()
        .expect("no other recorder is installed");

    let order_lock = KeyedLockLayer::by_path("order_id")
        .name("orders")
        .wait_timeout(WAIT_TIMEOUT)
        .max_waiters(MAX_WAITERS);
    let app = Router::new()
        .route("/orders/{order_id}/pay", post(pay))
        .route_layer(order_lock.clone())
        // Added after `.route_layer`, so scrapes do not go through the lock.
        .route("/metrics", get(metrics))
        .with_state(handle.clone());

    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    if serve_forever {
        let port = std::env::var("PORT").map_or(3000, |port| {
            port.parse().expect("PORT should be a port number")
        });
        let addr = serve(app, SocketAddr::from(([127, 0, 0, 1], port))).await;
        println!("serving http://{addr}/metrics; sending load every second (Ctrl-C stops)");
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut round = 0u64;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = tokio::signal::ctrl_c() => break,
            }
            round += 1;
            // Vary the burst size so the dashboard has something to show.
            let requests = 100 + 75 * (round % 5) as usize;
            let client = client.clone();
            tokio::spawn(async move {
                let tally = drive_load(&client, addr, requests, Duration::from_millis(800)).await;
                println!("round {round:>4}: {tally}");
            });
            if round % 5 == 0 {
                handle.run_upkeep();
            }
        }
        return;
    }

    let addr = serve(app, SocketAddr::from(([127, 0, 0, 1], 0))).await;
    let tally = drive_load(&client, addr, 300, Duration::from_millis(300)).await;
    println!("load: 300 requests over 6 orders: {tally}\n");

    let text = get_text(&client, addr, "/metrics").await;
    for line in text.lines().filter(|line| line.contains("keyed_lock_")) {
        println!("{line}");
    }
    check(&text, &tally);
    assert_eq!(order_lock.active_keys(), 0, "no key should stay locked");
    println!("\nok: every keyed_lock_* series is there and agrees with the client");
}

/// Serves `app` on `addr` in the background; returns the bound address.
async fn serve(app: Router, addr: SocketAddr) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|error| panic!("cannot bind {addr}: {error}"));
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Statuses the load driver saw.
#[derive(Default, Debug)]
struct Tally {
    ok: u64,
    timeout: u64,
    queue_full: u64,
    other: u64,
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "200 OK x{}, 409 Conflict (wait timeout) x{}, 429 Too Many Requests (queue full) x{}",
            self.ok, self.timeout, self.queue_full
        )?;
        if self.other > 0 {
            write!(f, ", other x{}", self.other)?;
        }
        Ok(())
    }
}

/// Sends `requests` payments with start times spread over `spread`: half of them for
/// order 1001 (hot), a fifth for 1002 (warm), the rest over 1003–1006.
async fn drive_load(
    client: &HttpClient,
    addr: SocketAddr,
    requests: usize,
    spread: Duration,
) -> Tally {
    let mut set = JoinSet::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    for i in 0..requests {
        let order = match i % 40 {
            0..20 => 1001,
            20..28 => 1002,
            n => 1003 + (n - 28) / 3,
        };
        // xorshift: arrival times scattered over `spread`, no dependency needed.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let delay = spread.mul_f64((seed >> 11) as f64 / (1u64 << 53) as f64);
        let request = Request::post(format!("http://{addr}/orders/{order}/pay"))
            .body(Empty::new())
            .unwrap();
        let client = client.clone();
        set.spawn(async move {
            tokio::time::sleep(delay).await;
            let response = client.request(request).await.expect("request failed");
            let status = response.status();
            response.into_body().collect().await.expect("body failed");
            status
        });
    }
    let mut tally = Tally::default();
    for status in set.join_all().await {
        match status {
            StatusCode::OK => tally.ok += 1,
            StatusCode::CONFLICT => tally.timeout += 1,
            StatusCode::TOO_MANY_REQUESTS => tally.queue_full += 1,
            _ => tally.other += 1,
        }
    }
    tally
}

async fn get_text(client: &HttpClient, addr: SocketAddr, path: &str) -> String {
    let request = Request::get(format!("http://{addr}{path}"))
        .body(Empty::new())
        .unwrap();
    let response = client.request(request).await.expect("GET failed");
    assert_eq!(response.status(), StatusCode::OK, "GET {path}");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).expect("metrics are UTF-8")
}

/// The sum of the samples of `metric` that carry every label in `labels`, or `None` if
/// there is no such sample.
fn sample(text: &str, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, label_text) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let has_labels = labels.iter().all(|(key, value)| {
            label_text
                .split(',')
                .any(|pair| pair == format!("{key}=\"{value}\""))
        });
        if name == metric && has_labels {
            let value: f64 = value.parse().expect("sample value is a number");
            *found.get_or_insert(0.0) += value;
        }
    }
    found
}

/// Checks that every series is exported for `name="orders"` and that the counts agree
/// with what the client saw.
fn check(text: &str, tally: &Tally) {
    let get = |metric: &str, labels: &[(&str, &str)]| {
        let mut all = vec![("name", "orders")];
        all.extend_from_slice(labels);
        sample(text, metric, &all).unwrap_or_else(|| panic!("no {metric} sample with {all:?}"))
    };

    assert_eq!(tally.other, 0, "only 200, 409 and 429 are expected");
    assert!(tally.ok > 0, "some payments should go through");
    assert!(
        tally.timeout + tally.queue_full > 0,
        "the hot order should turn some payments away"
    );

    // Real histograms (buckets), not summaries, for every wait outcome and for holds.
    for outcome in ["acquired", "timeout", "queue_full"] {
        get(
            "keyed_lock_wait_seconds_bucket",
            &[("outcome", outcome), ("le", "+Inf")],
        );
    }
    get("keyed_lock_hold_seconds_bucket", &[("le", "+Inf")]);

    let acquired = get("keyed_lock_acquired_total", &[]);
    let contended = get("keyed_lock_acquired_total", &[("contended", "true")]);
    let uncontended = get("keyed_lock_acquired_total", &[("contended", "false")]);
    assert!(
        contended > 0.0,
        "the hot order should make some payments wait"
    );
    assert!(uncontended > 0.0, "the quiet orders should often be free");
    assert_eq!(acquired, tally.ok as f64, "acquired_total vs 200s");
    assert_eq!(
        get("keyed_lock_wait_seconds_count", &[("outcome", "acquired")]),
        acquired
    );
    assert_eq!(get("keyed_lock_hold_seconds_count", &[]), acquired);

    get("keyed_lock_rejected_total", &[]);
    let timeouts = get("keyed_lock_rejected_total", &[("reason", "timeout")]);
    let queue_full = get("keyed_lock_rejected_total", &[("reason", "queue_full")]);
    assert_eq!(timeouts, tally.timeout as f64, "rejected timeout vs 409s");
    assert_eq!(
        queue_full, tally.queue_full as f64,
        "rejected queue_full vs 429s"
    );
    assert_eq!(
        get("keyed_lock_wait_seconds_count", &[("outcome", "timeout")]),
        timeouts
    );
    assert_eq!(
        get(
            "keyed_lock_wait_seconds_count",
            &[("outcome", "queue_full")]
        ),
        queue_full
    );

    assert_eq!(get("keyed_lock_keys", &[]), 0.0, "every key was released");
    assert_eq!(get("keyed_lock_waiting", &[]), 0.0, "nobody waits any more");
    for reason in ["unreachable", "expired", "not_owner", "shut_down"] {
        assert_eq!(
            get("keyed_lock_lease_lost_total", &[("reason", reason)]),
            0.0,
            "no lease in process"
        );
    }
}
