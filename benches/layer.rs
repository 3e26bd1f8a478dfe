//! Workload 6 of BENCHMARKS.md: what the layer adds to a request in process, with no
//! network: `ServiceExt::oneshot` (`ready()` then `call()`) on an axum `Router`, one
//! distinct key per request, on a current-thread runtime.
//!
//! ```text
//! cargo bench --bench layer                  # full run (about 30 seconds)
//! cargo bench --bench layer -- --test        # CI: each benchmark once
//! ```
//!
//! Variants: the bare router (`no-layer`), `KeyedLockLayer::by_path("order_id")`
//! (`keyed-lock`) and tower's `ConcurrencyLimitLayer` (`concurrency-limit`, a layer
//! every tower user knows, with one semaphore acquire and release per request).
//!
//! Two groups in one binary: first with no metrics recorder (the `metrics` facade's
//! no-op handles), then with `metrics-exporter-prometheus` installed and its upkeep
//! (draining histogram samples, as a scrape would) run every second on a thread of its
//! own. The layer registers its metric handles on its first request, against the
//! recorder global at that moment, so the second group builds fresh routers after the
//! recorder is installed.
//!
//! After each group, the bare router and the layered one also run in alternating
//! batches (A B, B A, …: the same load hits both), and the median of the per-round
//! differences is printed, in wall time and in CPU time (the on-CPU time of the
//! process's threads, which leaves out time other processes took): the target (≤ 250 ns
//! added per request) is judged on it, since criterion times one benchmark after
//! another. A full run writes those figures to
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
use tower_keyed_lock::KeyedLockLayer;

mod support;

use support::{criterion_dir, percentiles_f64, process_cpu_ns};

fn main() {
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
    Request::post(format!("/orders/{order}/pay"))
        .body(Body::empty())
        .expect("a valid request")
}

fn layer_group(c: &mut Criterion, rt: &Runtime, name: &str, args: &Args, report: &mut Vec<String>) {
    // Built here, after any recorder was installed; the layer is kept to check that its
    // table is empty afterwards.
    let keyed = KeyedLockLayer::by_path("order_id");
    let variants = [
        ("no-layer", finish(routes())),
        ("keyed-lock", finish(routes().layer(keyed.clone()))),
        (
            "concurrency-limit",
            finish(routes().layer(ConcurrencyLimitLayer::new(1024))),
        ),
    ];

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
        let [(base, base_router), rest @ ..] = &variants;
        let mut table = format!(
            "\n{section}: {} interleaved rounds of {} requests; medians per request\n\
             variant            clock  ns/request  no-layer ns  added ns  [p10 – p90]    ratio\n",
            args.rounds(),
            args.batch()
        );
        for (variant, router) in rest {
            let [wall, cpu] = paired(rt, args, base_router, router);
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
    assert_eq!(keyed.active_keys(), 0, "the layer left keys in its table");
}

/// Medians of an interleaved comparison, in ns per request.
struct Pair {
    base: f64,
    subject: f64,
    /// p10, p50, p90 of the per-round differences subject − base.
    added: [f64; 3],
    ratio: f64,
}

/// Runs `base` and `subject` in alternating batches and compares them round by round,
/// by wall time and by CPU time.
fn paired(rt: &Runtime, args: &Args, base: &Router, subject: &Router) -> [Pair; 2] {
    let mut next = 1_000_000_000;
    let mut batch = |router: &Router| {
        let requests: Vec<_> = (0..args.batch())
            .map(|_| {
                next += 1;
                request(next)
            })
            .collect();
        let mut responses = Vec::with_capacity(requests.len());
        let cpu = process_cpu_ns();
        let start = Instant::now();
        rt.block_on(async {
            for request in requests {
                responses.push(router.clone().oneshot(request).await);
            }
        });
        let wall = start.elapsed().as_nanos() as f64;
        let cpu = process_cpu_ns().saturating_sub(cpu) as f64;
        drop(responses);
        let n = args.batch() as f64;
        [wall / n, cpu / n]
    };
    batch(base);
    batch(subject);
    let mut rounds = Vec::new();
    for round in 0..args.rounds() {
        rounds.push(if round % 2 == 0 {
            let b = batch(base);
            (b, batch(subject))
        } else {
            let s = batch(subject);
            (batch(base), s)
        });
    }
    [0, 1].map(|clock| {
        let (mut bases, mut subjects, mut added, mut ratios) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (b, s) in &rounds {
            let (b, s) = (b[clock], s[clock]);
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
            // `cargo bench` passes `--bench`; `-- --test` and `cargo test --benches`
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
            31
        }
    }

    fn batch(&self) -> usize {
        if self.quick {
            8
        } else {
            20_000
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
