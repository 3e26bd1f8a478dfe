//! Workload 6 of BENCHMARKS.md: what the layer adds to a request in process, with no
//! network: `ServiceExt::oneshot` (`ready()` then `call()`) on an axum `Router`, one
//! distinct key per request, on a current-thread runtime.
//!
//! ```text
//! cargo bench -p tower-keyed-lock-benches --bench layer                  # full run (about 30 seconds)
//! cargo bench -p tower-keyed-lock-benches --bench layer -- --test        # CI: each benchmark once
//! ```
//!
//! Variants: the bare router (`no-layer`); `KeyedLockLayer` keyed by the path parameter
//! (`by-path`), by a header (`by-header`) and by a request extension (`by-extension`,
//! inserted when the request is built, as an auth layer would); tower's
//! `ConcurrencyLimitLayer` (`concurrency-limit`, a layer every tower user knows, with
//! one semaphore acquire and release per request); and tower_governor's keyed
//! `GovernorLayer` (`governor-keyed`, the keyed peer: a rate limiter keyed by the same
//! header, with a limit no request reaches). Every request carries the path parameter,
//! the header and the extension, so every variant gets the same input.
//!
//! Two groups in one binary: first with no metrics recorder (the `metrics` facade's
//! no-op handles), then with `metrics-exporter-prometheus` installed and its upkeep
//! (draining histogram samples, as a scrape would) run every second on a thread of its
//! own. The layer registers its metric handles on its first request, against the
//! recorder global at that moment, so the second group builds fresh routers after the
//! recorder is installed.
//!
//! After each group, every variant also runs once per round, in an order that rotates
//! and reverses from round to round (the same load and the same drift hit all of them),
//! and the median of the per-round differences to the bare router is printed, in wall
//! time and in CPU time (the on-CPU time of the process's threads, which leaves out time
//! other processes took): targets are judged on it, since criterion times one benchmark
//! after another. A full run writes those figures to
//! `<target>/criterion/tkl-custom/layer.jsonl` for `scripts/bench-charts`.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use criterion::{BatchSize, Criterion, Throughput};
use http::{Request, StatusCode};
use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::runtime::Runtime;
use tower::limit::ConcurrencyLimitLayer;
use tower::ServiceExt;
use tower_governor::governor::GovernorConfigBuilder;
use tower_governor::key_extractor::KeyExtractor as GovernorKey;
use tower_governor::{GovernorError, GovernorLayer};
use tower_keyed_lock::KeyedLockLayer;

mod support;

use support::{criterion_dir, percentiles_f64, process_cpu_ns};

fn main() {
    if let Ok(spec) = std::env::var("TKL_LAYER_INSTRUCTIONS") {
        return count_instructions(&spec);
    }
    let mut c = Criterion::default()
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .configure_from_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let args = Args::parse();
    let mut report = Vec::new();

    layer_group(&mut c, &rt, "6-layer-no-recorder", &args, &mut report);

    let handle = PrometheusBuilder::new()
        .install_recorder()
        .expect("the only recorder of this process");
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_secs(1));
        handle.run_upkeep();
    });
    layer_group(&mut c, &rt, "6-layer-prometheus", &args, &mut report);

    c.final_summary();
    write_report(&args, &report);
}

async fn pay() -> &'static str {
    "paid"
}

fn routes() -> Router {
    Router::new().route("/orders/{order_id}/pay", post(pay))
}

/// The router as `axum::serve` runs it: `with_state` turns every handler into a route
/// once. A `Router<()>` called as a service without it converts the handler, and applies
/// every layer again, on each request, which would dwarf what is measured here.
fn finish(router: Router) -> Router {
    router.with_state(())
}

fn request(order: u64) -> Request<Body> {
    let mut request = Request::post(format!("/orders/{order}/pay"))
        .header("x-order", order)
        .body(Body::empty())
        .expect("a valid request");
    request.extensions_mut().insert(OrderId(order));
    request
}

/// The key an auth-like layer would have put in the extensions.
#[derive(Clone)]
struct OrderId(u64);

impl std::fmt::Display for OrderId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// tower_governor keyed by the `x-order` header, like `by-header`.
#[derive(Clone)]
struct OrderHeader;

impl GovernorKey for OrderHeader {
    type Key = String;

    fn extract<T>(&self, request: &Request<T>) -> Result<String, GovernorError> {
        let value = request.headers().get("x-order");
        let value = value.and_then(|v| v.to_str().ok());
        value
            .map(str::to_owned)
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

/// A keyed rate limit that no request reaches: one token per nanosecond per key, and
/// a burst as large as it gets.
fn governor_layer() -> GovernorLayer<OrderHeader, governor::middleware::NoOpMiddleware, Body> {
    let config = GovernorConfigBuilder::default()
        .per_nanosecond(1)
        .burst_size(u32::MAX)
        .key_extractor(OrderHeader)
        .finish()
        .expect("a valid governor configuration");
    GovernorLayer::new(config)
}

/// The variants, in the order they are reported.
const VARIANTS: [&str; 6] = [
    "no-layer",
    "concurrency-limit",
    "governor-keyed",
    "by-path",
    "by-header",
    "by-extension",
];

/// The router of one variant, built after any recorder was installed.
fn variant(name: &str) -> Router {
    let router = match name {
        "no-layer" => routes(),
        "concurrency-limit" => routes().layer(ConcurrencyLimitLayer::new(1024)),
        "governor-keyed" => routes().layer(governor_layer()),
        "by-path" => routes().layer(KeyedLockLayer::by_path("order_id")),
        "by-header" => routes().layer(KeyedLockLayer::by_header("x-order")),
        "by-extension" => routes().layer(KeyedLockLayer::by_extension::<OrderId>()),
        other => panic!("no variant {other:?}"),
    };
    finish(router)
}

/// `TKL_LAYER_INSTRUCTIONS=<variant>:<requests>[:prometheus]`: runs that many requests
/// through one variant and exits, for `scripts/bench-instructions`, which counts the
/// instructions under callgrind: on a shared machine, the one measure no other process
/// disturbs. Requests are built before the loop, as in the timed runs.
fn count_instructions(spec: &str) {
    let mut parts = spec.split(':');
    let (Some(name), Some(count)) = (parts.next(), parts.next()) else {
        panic!(
            "TKL_LAYER_INSTRUCTIONS=<variant>:<requests>[:prometheus][:info|:debug], not {spec:?}"
        );
    };
    let count: u64 = count.parse().expect("a request count");
    // Then what is installed: `prometheus` (a metrics recorder), `info` or `debug` (a
    // `tracing` subscriber writing to nowhere at that level: the layer's spans are
    // DEBUG, so `info` has them disabled and `debug` records them).
    for extra in parts {
        match extra {
            "prometheus" => {
                PrometheusBuilder::new()
                    .install_recorder()
                    .expect("the only recorder of this process");
            }
            "info" | "debug" => tracing_subscriber::fmt()
                .with_max_level(match extra {
                    "info" => tracing::Level::INFO,
                    _ => tracing::Level::DEBUG,
                })
                .with_writer(std::io::sink)
                .init(),
            other => panic!("unknown TKL_LAYER_INSTRUCTIONS part {other:?}"),
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    // Only this variant is built: tower_governor's clock calibrates itself for a
    // while, which would add a varying count to every variant.
    let router = variant(name);
    // One request first, so one-time setup (metric handles, axum's first call) is not
    // counted per request.
    let requests: Vec<_> = (0..=count).map(request).collect();
    rt.block_on(async {
        for request in requests {
            let response = router.clone().oneshot(request).await.expect("infallible");
            assert_eq!(response.status(), StatusCode::OK);
        }
    });
}

fn layer_group(c: &mut Criterion, rt: &Runtime, name: &str, args: &Args, report: &mut Vec<String>) {
    // Built here, after any recorder was installed; the layer is kept to check that its
    // table is empty afterwards.
    let variants: Vec<_> = VARIANTS.iter().map(|name| (*name, variant(name))).collect();
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(1));
    for (variant, router) in &variants {
        let response = rt.block_on(router.clone().oneshot(request(0)));
        let response = response.expect("axum routers are infallible");
        assert_eq!(response.status(), StatusCode::OK, "{variant}");

        let mut next = 0;
        group.bench_function(*variant, |b| {
            // The request is built outside the timed region; the response is dropped
            // after it (its body is never read).
            b.to_async(rt).iter_batched(
                || {
                    next += 1;
                    request(next)
                },
                |request| router.clone().oneshot(request),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();

    let section = format!("{name}-paired");
    if args.selected(&section) {
        let [(base, _), rest @ ..] = &variants[..] else {
            unreachable!("the bare router comes first")
        };
        let mut table = format!(
            "\n{section}: {} rounds of {} requests, every variant once per round; medians \
             per request\n\
             variant            clock  ns/request  no-layer ns  added ns  [p10 – p90]    ratio\n",
            args.rounds(),
            args.batch()
        );
        let against_bare = rotated(rt, args, &VARIANTS);
        for ((variant, _), [wall, cpu]) in rest.iter().zip(against_bare) {
            for (clock, pair) in [("wall", &wall), ("cpu", &cpu)] {
                let _ = writeln!(
                    table,
                    "{variant:<18} {clock:<5} {:>10.0} {:>12.0} {:>9.0}  [{:.0} – {:.0}] {:>7.3}",
                    pair.subject,
                    pair.base,
                    pair.added[1],
                    pair.added[0],
                    pair.added[2],
                    pair.ratio
                );
            }
            report.push(format!(
                r#"{{"workload":"{section}","impl":"{variant}","base":"{base}","rounds":{},"requests_per_batch":{},"ns_per_request":{:.1},"base_ns_per_request":{:.1},"added_ns_p50":{:.1},"added_ns_p10":{:.1},"added_ns_p90":{:.1},"time_ratio_p50":{:.4},"cpu_ns_per_request":{:.1},"base_cpu_ns_per_request":{:.1},"cpu_added_ns_p50":{:.1},"cpu_added_ns_p10":{:.1},"cpu_added_ns_p90":{:.1},"cpu_ratio_p50":{:.4}}}"#,
                args.rounds(),
                args.batch(),
                wall.subject,
                wall.base,
                wall.added[1],
                wall.added[0],
                wall.added[2],
                wall.ratio,
                cpu.subject,
                cpu.base,
                cpu.added[1],
                cpu.added[0],
                cpu.added[2],
                cpu.ratio
            ));
        }
        println!("{table}");
    }
}

/// Medians of an interleaved comparison, in ns per request.
struct Pair {
    base: f64,
    subject: f64,
    /// p10, p50, p90 of the per-round differences subject − base.
    added: [f64; 3],
    ratio: f64,
}

/// Runs a batch of every variant in each round, in an order that rotates and reverses
/// from round to round, and compares each variant after the first (the bare router)
/// with the first, round by round, by wall time and by CPU time. The routers are built
/// anew each round: tower_governor's table keeps every key it has seen, and grown over
/// a whole run it slowed every variant measured near it.
fn rotated(rt: &Runtime, args: &Args, variants: &[&str]) -> Vec<[Pair; 2]> {
    let mut next = 1_000_000_000;
    let mut batch = |router: &Router| {
        let requests: Vec<_> = (0..args.batch())
            .map(|_| {
                next += 1;
                request(next)
            })
            .collect();
        let cpu = process_cpu_ns();
        let start = Instant::now();
        rt.block_on(async {
            for request in requests {
                // Dropped at once, as a server would after writing it: twenty thousand
                // responses kept alive made every variant slower by a cache miss each.
                let response = router.clone().oneshot(request).await;
                assert!(response.expect("infallible").status().is_success());
            }
        });
        let wall = start.elapsed().as_nanos() as f64;
        let cpu = process_cpu_ns().saturating_sub(cpu) as f64;
        let n = args.batch() as f64;
        [wall / n, cpu / n]
    };
    for name in variants {
        batch(&variant(name)); // warm-up
    }
    let mut rounds = Vec::new();
    for round in 0..args.rounds() {
        let routers: Vec<Router> = variants.iter().map(|name| variant(name)).collect();
        let mut order: Vec<usize> = (0..routers.len()).collect();
        order.rotate_left(round % routers.len());
        if round % 2 == 1 {
            order.reverse();
        }
        let mut times = vec![[0.0; 2]; routers.len()];
        for index in order {
            times[index] = batch(&routers[index]);
        }
        rounds.push(times);
    }
    (1..variants.len())
        .map(|subject| compare(&rounds, subject))
        .collect()
}

/// The medians of router `subject` against router 0 over `rounds` (per round, per
/// router: ns per request by wall time and by CPU time).
fn compare(rounds: &[Vec<[f64; 2]>], subject: usize) -> [Pair; 2] {
    [0, 1].map(|clock| {
        let (mut bases, mut subjects, mut added, mut ratios) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for times in rounds {
            let (b, s) = (times[0][clock], times[subject][clock]);
            bases.push(b);
            subjects.push(s);
            added.push(s - b);
            ratios.push(s / b.max(f64::MIN_POSITIVE));
        }
        Pair {
            base: percentiles_f64(&mut bases, [0.5])[0],
            subject: percentiles_f64(&mut subjects, [0.5])[0],
            added: percentiles_f64(&mut added, [0.1, 0.5, 0.9]),
            ratio: percentiles_f64(&mut ratios, [0.5])[0],
        }
    })
}

/// The command line as far as the paired runs need it.
struct Args {
    quick: bool,
    filters: Vec<String>,
}

impl Args {
    fn parse() -> Self {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let has = |flag: &str| args.iter().any(|a| a == flag);
        Self {
            // `cargo bench -p tower-keyed-lock-benches` passes `--bench`; `-- --test` and `cargo test --benches`
            // run each benchmark once.
            quick: has("--test") || !has("--bench") || has("--list"),
            // Criterion's options with values are not used with this bench; every
            // other word is a name filter.
            filters: args.into_iter().filter(|a| !a.starts_with('-')).collect(),
        }
    }

    fn selected(&self, name: &str) -> bool {
        self.filters.is_empty() || self.filters.iter().any(|f| name.contains(f.as_str()))
    }

    fn rounds(&self) -> usize {
        if self.quick {
            1
        } else {
            121
        }
    }

    fn batch(&self) -> usize {
        if self.quick {
            8
        } else {
            5_000
        }
    }
}

/// Writes `<criterion dir>/tkl-custom/layer.jsonl` after a full run.
fn write_report(args: &Args, lines: &[String]) {
    if args.quick || lines.is_empty() {
        return;
    }
    let dir = criterion_dir().join("tkl-custom");
    let path = dir.join("layer.jsonl");
    let text: String = lines.iter().map(|line| format!("{line}\n")).collect();
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
        Ok(()) => println!("custom results written to {}", path.display()),
        Err(error) => eprintln!("could not write {}: {error}", path.display()),
    }
}
