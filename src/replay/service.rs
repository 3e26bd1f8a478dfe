//! The `Service` of [`ReplayLayer`](super::ReplayLayer).

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::body::ReplayBody;
use super::future::ReplayFuture;
use super::lookup::FoundInMemory;
use super::respond::{replay_found_in_memory, respond};
use super::shared::{Settings, Shared};

/// The service [`ReplayLayer`](super::ReplayLayer) makes.
pub struct Replay<S> {
    inner: S,
    settings: Arc<Settings>,
    shared: Arc<Shared>,
}

impl<S> Replay<S> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>, shared: Arc<Shared>) -> Self {
        Self {
            inner,
            settings,
            shared,
        }
    }

    inner_service_accessors!();
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Replay<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send,
{
    type Response = Response<ReplayBody<ResBody>>;
    type Error = S::Error;
    type Future = ReplayFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        // Found in memory before the lock layer took the key: replayed without the
        // inner service (and without its clone).
        if let Some(found) = request.extensions_mut().remove::<FoundInMemory>() {
            return replay_found_in_memory(&self.settings, &self.shared, found, request);
        }
        // Call the service that was readied; leave a fresh clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ReplayFuture::new(respond(
            inner,
            Arc::clone(&self.settings),
            Arc::clone(&self.shared),
            request,
        ))
    }
}

impl<S: Clone> Clone for Replay<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            settings: Arc::clone(&self.settings),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for Replay<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replay")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::Full;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use tower::{service_fn, Layer, ServiceExt};

    use crate::replay::{MemoryStore, ReplayLayer, REPLAYED_TOTAL};
    use crate::KeyedLockLayer;

    /// One `ReplayLayer` value under two named lock layers counts each layer's replays
    /// under that layer's name (it used to count both under the first name it saw).
    #[tokio::test]
    async fn one_replay_layer_under_two_lock_layers_counts_under_each_name() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let _local = metrics::set_default_local_recorder(&recorder);

        let replay = ReplayLayer::new(MemoryStore::default());
        let handler = service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        });
        for name in ["orders", "refunds"] {
            let service = KeyedLockLayer::by_header("idempotency-key")
                .name(name)
                .replay(replay.clone())
                .layer(handler);
            for _ in 0..2 {
                let request = Request::builder()
                    .uri("/x")
                    .header("idempotency-key", "k")
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                service.clone().oneshot(request).await.unwrap();
            }
        }

        let mut replayed = Vec::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            if let (REPLAYED_TOTAL, DebugValue::Counter(n)) = (key.name(), value) {
                let name = key.labels().find(|label| label.key() == "name").unwrap();
                replayed.push((name.value().to_owned(), n));
            }
        }
        replayed.sort();
        assert_eq!(
            replayed,
            [("orders".to_owned(), 1), ("refunds".to_owned(), 1)]
        );
    }
}
