//! Round trips per request on the wire: a lock and a replay store whose connections go
//! through a proxy that counts each time a client speaks after its server has (the
//! tests' fault proxy), counted before the handler, between it and the answer, and
//! after the answer.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use tower::util::BoxCloneSyncService;
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};
use tower_keyed_lock::key::HeaderKey;
use tower_keyed_lock::replay::{ReplayLayer, ReplayStore};
use tower_keyed_lock::KeyedLockLayer;

use super::tcp_proxy::TcpProxy;

type Stack = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// The count of one request: before the handler (all until the answer when it did not
/// run), between the handler and the answer, and in the 300 ms after.
pub struct Count {
    pub before: u64,
    pub after: u64,
    pub later: u64,
}

impl Count {
    /// The median of each part.
    fn median(counts: Vec<Count>) -> Count {
        let median = |part: fn(&Count) -> u64| {
            let mut values: Vec<u64> = counts.iter().map(part).collect();
            values.sort_unstable();
            values[values.len() / 2]
        };
        Count {
            before: median(|c| c.before),
            after: median(|c| c.after),
            later: median(|c| c.later),
        }
    }
}

/// Counts, for `lock` alone and for `lock` with `store` stacked both ways, first
/// requests and replays; prints each and returns them as JSON lines.
pub async fn count(
    engine: &str,
    proxy: Arc<TcpProxy>,
    lock: KeyedLockLayer<HeaderKey>,
    store: impl ReplayStore + Clone,
) -> Vec<String> {
    let marks = Marks::new(proxy);
    let plain = marks.stack(lock.clone());
    let looked_up = marks.stack(lock.clone().replay(ReplayLayer::new(store.clone())));
    let by_hand = marks.stack(
        ServiceBuilder::new()
            .layer(lock)
            .layer(ReplayLayer::new(store)),
    );
    let mut lines = Vec::new();
    for (stacking, stack) in [
        ("lock only", &plain),
        ("lock.replay", &looked_up),
        ("by hand", &by_hand),
    ] {
        // Tables, prepared statements, scripts, sessions: made on first use.
        for warm in ["warm-1", "warm-2", "warm-3"] {
            marks.request(stack, warm).await;
            marks.request(stack, warm).await;
        }
        // Five of each, and the median of each part: a connection's own keep-alive (the
        // Redis release subscription pings every second) falls in one at most.
        let mut counts: [Vec<Count>; 2] = [Vec::new(), Vec::new()];
        for round in 0..5 {
            let key = format!("counted-{stacking}-{round}");
            counts[0].push(marks.request(stack, &key).await);
            counts[1].push(marks.request(stack, &key).await);
        }
        for (request, counts) in ["first", "replay"].into_iter().zip(counts) {
            if stacking == "lock only" && request == "replay" {
                continue;
            }
            let count = Count::median(counts);
            println!(
                "round trips, {engine}, {stacking}, {request}: {} before the handler, {} \
                 between it and the answer, {} after the answer",
                count.before, count.after, count.later
            );
            lines.push(format!(
                r#"{{"workload":"round-trips","engine":"{engine}","stacking":"{stacking}","request":"{request}","before":{},"after":{},"later":{}}}"#,
                count.before, count.after, count.later
            ));
        }
    }
    lines
}

/// The proxy's count at the handler and at the answer.
struct Marks {
    proxy: Arc<TcpProxy>,
    at_handler: Arc<AtomicU64>,
    at_answer: Arc<AtomicU64>,
}

impl Marks {
    fn new(proxy: Arc<TcpProxy>) -> Self {
        Self {
            proxy,
            at_handler: Arc::new(AtomicU64::new(u64::MAX)),
            at_answer: Arc::new(AtomicU64::new(0)),
        }
    }

    /// `layer` around a handler that marks when it runs, itself in a layer that marks
    /// the answer (before the lock's guard is dropped and its release spawned).
    fn stack<L, B>(&self, layer: L) -> Stack
    where
        L: Layer<Stack>,
        L::Service: tower::Service<Request<Body>, Response = Response<B>, Error = Infallible>
            + Clone
            + Send
            + Sync
            + 'static,
        <L::Service as tower::Service<Request<Body>>>::Future: Send + 'static,
        B: axum::body::HttpBody<Data = axum::body::Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (proxy, at_handler) = (Arc::clone(&self.proxy), Arc::clone(&self.at_handler));
        let handler = service_fn(move |_: Request<Body>| {
            at_handler.store(proxy.round_trips(), Ordering::SeqCst);
            std::future::ready(Ok(Response::new(Body::from("done"))))
        });
        let (proxy, at_answer) = (Arc::clone(&self.proxy), Arc::clone(&self.at_answer));
        let service = layer.layer(BoxCloneSyncService::new(handler)).map_response(
            move |response: Response<B>| {
                at_answer.store(proxy.round_trips(), Ordering::SeqCst);
                response.map(Body::new)
            },
        );
        BoxCloneSyncService::new(service)
    }

    async fn request(&self, stack: &Stack, key: &str) -> Count {
        self.at_handler.store(u64::MAX, Ordering::SeqCst);
        let start = self.proxy.round_trips();
        let request = Request::post("/orders")
            .header("idempotency-key", key)
            .body(Body::from("{}"))
            .unwrap();
        let response = stack.clone().oneshot(request).await.unwrap();
        assert!(response.status().is_success(), "{response:?}");
        let answered = self.at_answer.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let later = self.proxy.round_trips() - answered;
        match self.at_handler.load(Ordering::SeqCst) {
            u64::MAX => Count {
                before: answered - start,
                after: 0,
                later,
            },
            ran => Count {
                before: ran - start,
                after: answered - ran,
                later,
            },
        }
    }
}
