//! A soak run over several instances of one service (one layer and one hyper server
//! each): random keys, random handler delays, random client disconnects, optional
//! faults injected meanwhile. Every handler checks that a holder already inside its key
//! had been told its lease was lost (`occupancy`).
#![allow(dead_code)]

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Extension, Path, State};
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use tokio::time::Instant;
use tower_keyed_lock::{KeyedLockLayer, LockInfo, PathParam};

use super::occupancy::Occupancy;
use super::{serve, Server};

pub struct Soak {
    /// The most requests sent; fewer when the time box ([`time_box`]) ends first.
    pub requests: u64,
    pub keys: usize,
    pub clients: usize,
}

/// How long a soak sends requests: `SOAK_SECONDS` (default 15; `0`: until `requests`
/// are sent, as `scripts/test --long` runs them). The guarantees are checked on every
/// request sent, so a loaded machine sends fewer in the same time and checks as much
/// per request; the run's length no longer grows with the load.
pub fn time_box() -> Option<Duration> {
    let seconds = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    (seconds > 0).then(|| Duration::from_secs(seconds))
}

/// A request not answered within this is a hang. Far beyond any bound of the layers
/// under test (a wait of 2 s, a command timeout of 300 ms): on a loaded 2-core machine,
/// 512 clients queue behind each other for seconds, and that is not what the soak is
/// about. That each wait ends by its own deadline is asserted against the test's own
/// observations by the fault checks (`no_acquisition_outlives_its_wait_on_a_silent_path`).
pub const HANG: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub struct Report {
    /// Requests sent: each is answered, cancelled by its client, or hung.
    pub sent: u64,
    pub ok: u64,
    pub conflict: u64,
    pub unavailable: u64,
    pub other: u64,
    pub cancelled: u64,
    pub hung: u64,
    /// Holders that another holder of their key overlapped before they were told their
    /// lease was lost, and that were still not told when they left: what the
    /// guarantee forbids.
    pub overlaps: u64,
    /// Holders overlapped before they were told, and told before they left (a server
    /// that ended the session itself, before the holder's watch ran; allowed).
    pub told_late_overlaps: u64,
    /// Second holders after every holder inside had been told (allowed).
    pub signalled_overlaps: u64,
    pub lease_lost: u64,
    pub slowest: Duration,
}

impl Report {
    pub fn answered(&self) -> u64 {
        self.ok + self.conflict + self.unavailable + self.other
    }
}

#[derive(Default)]
struct Keys {
    inside: Occupancy<usize>,
    lease_lost: AtomicU64,
}

async fn handle(
    State(keys): State<Arc<Keys>>,
    Path(id): Path<usize>,
    Extension(info): Extension<LockInfo>,
) {
    let _inside = keys.inside.enter(id, info.lease());
    let delay = mix(id as u64 ^ info.waited().as_nanos() as u64) % 2_000;
    if delay > 200 {
        tokio::time::sleep(Duration::from_micros(delay)).await;
    }
    if info.is_lease_lost() {
        keys.lease_lost.fetch_add(1, Ordering::SeqCst);
    }
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Soak {
    /// Serves one instance per layer and drives them until `requests` are answered or
    /// cancelled; `faults` runs alongside and is dropped when the load ends.
    pub async fn run(
        &self,
        layers: &[KeyedLockLayer<PathParam>],
        faults: impl Future<Output = ()>,
    ) -> Report {
        let _turn = super::soak_turn().await;
        let keys = Arc::new(Keys::default());
        let mut servers = Vec::new();
        for layer in layers {
            let app = Router::new()
                .route("/orders/{id}", post(handle))
                .with_state(keys.clone())
                .layer(layer.clone());
            servers.push(Arc::new(serve(app).await));
        }
        let servers = Arc::new(servers);
        let next = Arc::new(AtomicU64::new(0));
        let stop_at = time_box().map(|length| Instant::now() + length);
        let report = Arc::new(std::sync::Mutex::new(Report::default()));

        let clients: Vec<_> = (0..self.clients)
            .map(|_| {
                let (servers, next, report) = (servers.clone(), next.clone(), report.clone());
                let (total, key_count) = (self.requests, self.keys as u64);
                tokio::spawn(async move {
                    loop {
                        if stop_at.is_some_and(|stop_at| Instant::now() >= stop_at) {
                            break;
                        }
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        if n >= total {
                            break;
                        }
                        let r = mix(n);
                        let server: &Server = &servers[(r >> 40) as usize % servers.len()];
                        let path = format!("/orders/{}", r % key_count);
                        let started = Instant::now();
                        // One request in 20 disconnects after 0–3 ms.
                        let patience = if r % 20 == 0 {
                            Duration::from_micros((r >> 8) % 3_000)
                        } else {
                            HANG
                        };
                        let status = tokio::time::timeout(patience, server.post(&path))
                            .await
                            .ok()
                            .map(|a| a.status);
                        let took = started.elapsed();
                        let mut report = report.lock().unwrap();
                        report.sent += 1;
                        report.slowest = report.slowest.max(took);
                        match status {
                            Some(StatusCode::OK) => report.ok += 1,
                            Some(StatusCode::CONFLICT) => report.conflict += 1,
                            Some(StatusCode::SERVICE_UNAVAILABLE) => report.unavailable += 1,
                            Some(_) => report.other += 1,
                            None if patience < HANG => report.cancelled += 1,
                            None => report.hung += 1,
                        }
                    }
                })
            })
            .collect();

        let load = async {
            for client in clients {
                client.await.unwrap();
            }
        };
        tokio::pin!(load);
        tokio::select! {
            () = &mut load => {}
            () = faults => load.await,
        }

        // Cancelled requests leave as the server notices their connections closed.
        super::eventually("every layer's table empties", || {
            layers.iter().all(|l| l.active_keys() == 0)
        })
        .await;
        let mut report = std::mem::take(&mut *report.lock().unwrap());
        report.overlaps = keys.inside.unsignalled_overlaps();
        report.signalled_overlaps = keys.inside.signalled_overlaps();
        report.told_late_overlaps = keys.inside.told_late_overlaps();
        report.lease_lost = keys.lease_lost.load(Ordering::SeqCst);
        report
    }
}

/// Sends single requests to each instance until one is served (its backend
/// connection is back: the first command on a broken connection fails, and that
/// request gets 503), failing the test after [`HANG`] with the last answer.
///
/// The tries back off (50 ms doubling to 1 s): a server that queued the requests of an
/// outage (moto serves one at a time) drains its queue instead of receiving a new try,
/// and a give-back, every few milliseconds. A failure also shows what `server_state`
/// says (what the server sees of its clients, for one).
pub async fn wait_until_served(
    layers: &[KeyedLockLayer<PathParam>],
    server_state: impl Fn() -> String,
) {
    let keys = Arc::new(Keys::default());
    let deadline = Instant::now() + HANG;
    for layer in layers {
        let app = Router::new()
            .route("/orders/{id}", post(handle))
            .with_state(keys.clone())
            .layer(layer.clone());
        let server = serve(app).await;
        let mut pause = Duration::from_millis(50);
        loop {
            let answer = server.post("/orders/0").await;
            if answer.status == StatusCode::OK {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the layer did not recover within {HANG:?}; its last answer: {} {}; \
                 the server: {}",
                answer.status,
                answer.body,
                server_state()
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
    }
}
