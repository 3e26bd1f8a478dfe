//! The `Service` of [`ReplayLayer`](super::ReplayLayer).

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::body::ReplayBody;
use super::future::{respond, ReplayFuture};
use super::layer::{Settings, Shared};

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

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
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
