//! Reading the request body before the key is taken.
//!
//! The lock layer takes the key before the handler reads the body, so a client that
//! trickles its body (one byte every 300 ms) holds the key for everyone else while it
//! does. [`BufferRequestBodyLayer`] placed *outside* the lock reads the whole body first,
//! within a size limit (then 413) and a read timeout (then 408), and hands the inner
//! service a request whose body is already in memory.
//!
//! ```
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::{BufferRequestBodyLayer, KeyedLockLayer};
//!
//! let app: Router = Router::new()
//!     .route("/orders/{order_id}/pay", post(|body: String| async move { body }))
//!     .layer(KeyedLockLayer::by_path("order_id"))
//!     // Added last, so it runs first: the body is read before the key is taken.
//!     .layer(
//!         BufferRequestBodyLayer::new()
//!             .limit(64 * 1024)
//!             .read_timeout(Duration::from_secs(5)),
//!     );
//! ```
//!
//! The bytes read are also put in the request extensions as a [`BufferedBody`], so a
//! key extractor can read the body (`JsonBodyKey`, with the `json` feature) while the
//! handler still gets the whole body.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::time::Duration;

use bytes::Bytes;
use http::{header::CONTENT_LENGTH, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_layer::Layer;
use tower_service::Service;

use crate::body::InnerOrFull;

/// The response body of [`BufferRequestBody`]: the inner service's body, or the
/// layer's own rejection. The lock and replay layers' bodies wrap the same type.
pub use crate::body::InnerOrFull as ResponseBody;
use crate::reject::Rejection;

/// The default [`limit`](BufferRequestBodyLayer::limit): 1 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;
/// The default [`read_timeout`](BufferRequestBodyLayer::read_timeout): 10 s.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The request body as [`BufferRequestBodyLayer`] read it, in the request extensions:
/// what a key extractor that reads the body (`JsonBodyKey`) takes its key from. The
/// handler still gets the same bytes as its body; this is a second reference to them,
/// not a copy.
///
/// ```
/// use bytes::Bytes;
/// use http::Request;
/// use tower_keyed_lock::BufferedBody;
///
/// let mut request = Request::new(());
/// request.extensions_mut().insert(BufferedBody::new(Bytes::from_static(b"{}")));
/// let body = request.extensions().get::<BufferedBody>().unwrap();
/// assert_eq!(body.bytes(), &b"{}"[..]);
/// ```
#[derive(Debug, Clone)]
pub struct BufferedBody(Bytes);

impl BufferedBody {
    /// Wraps `bytes`, e.g. for a layer of your own that reads the body first.
    pub fn new(bytes: Bytes) -> Self {
        BufferedBody(bytes)
    }

    /// The whole request body.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }
}

/// Reads the whole request body before calling the inner service; see the
/// [module docs](self).
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct BufferRequestBodyLayer {
    limit: usize,
    read_timeout: Duration,
}

impl BufferRequestBodyLayer {
    /// A limit of [`DEFAULT_BODY_LIMIT`] and a read timeout of [`DEFAULT_READ_TIMEOUT`].
    pub fn new() -> Self {
        Self {
            limit: DEFAULT_BODY_LIMIT,
            read_timeout: DEFAULT_READ_TIMEOUT,
        }
    }

    /// The longest body accepted, in bytes; a longer one gets 413 Payload Too Large
    /// (at once when its `Content-Length` says so).
    pub fn limit(mut self, bytes: usize) -> Self {
        self.limit = bytes;
        self
    }

    /// How long the whole body may take to arrive; then 408 Request Timeout.
    pub fn read_timeout(mut self, timeout: Duration) -> Self {
        self.read_timeout = timeout;
        self
    }
}

impl Default for BufferRequestBodyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Layer<S> for BufferRequestBodyLayer {
    type Service = BufferRequestBody<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BufferRequestBody {
            inner,
            settings: *self,
        }
    }
}

/// The service of [`BufferRequestBodyLayer`].
#[derive(Debug, Clone)]
pub struct BufferRequestBody<S> {
    inner: S,
    settings: BufferRequestBodyLayer,
}

impl<S> BufferRequestBody<S> {
    inner_service_accessors!();
}

/// Why a body could not be read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BodyReadError {
    TooLarge,
    Timeout,
    /// The client sent a broken body or went away.
    Broken,
}

impl BodyReadError {
    pub(crate) fn rejection(&self, limit: usize) -> Rejection {
        match self {
            BodyReadError::TooLarge => Rejection::body_too_large(limit),
            BodyReadError::Timeout => Rejection::body_late(),
            BodyReadError::Broken => Rejection::body_broken(),
        }
    }
}

/// Reads `body` to the end, at most `limit` bytes within `read_timeout`.
pub(crate) async fn read_body<B>(
    content_length: Option<u64>,
    body: B,
    limit: usize,
    read_timeout: Duration,
) -> Result<Bytes, BodyReadError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if content_length.is_some_and(|len| len > limit as u64) {
        return Err(BodyReadError::TooLarge);
    }
    // A body already here (buffered by an outer layer, or a whole `Full`) is read
    // without arming a timer.
    let collect = Limited::new(body, limit).collect();
    let Some(read) = crate::within::within(read_timeout, collect).await else {
        return Err(BodyReadError::Timeout);
    };
    match read {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<LengthLimitError>() => Err(BodyReadError::TooLarge),
        Err(_) => Err(BodyReadError::Broken),
    }
}

/// The declared `Content-Length`, if it is a number.
pub(crate) fn content_length<B>(request: &Request<B>) -> Option<u64> {
    request
        .headers()
        .get(CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for BufferRequestBody<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = BufferFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Call the service that was readied; leave a fresh clone in its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let settings = self.settings;
        BufferFuture(Box::pin(async move {
            let length = content_length(&request);
            let (mut parts, body) = request.into_parts();
            match read_body(length, body, settings.limit, settings.read_timeout).await {
                Ok(bytes) => {
                    parts.extensions.insert(BufferedBody(bytes.clone()));
                    let response = inner
                        .call(Request::from_parts(parts, ReqBody::from(bytes)))
                        .await?;
                    Ok(response.map(InnerOrFull::inner))
                }
                Err(error) => Ok(error
                    .rejection(settings.limit)
                    .into_response()
                    .map(InnerOrFull::full)),
            }
        }))
    }
}

/// The response future of [`BufferRequestBody`]: reads the body, then runs the inner
/// service. Dropping it drops whatever of the body was read.
pub struct BufferFuture<T>(Pin<Box<dyn Future<Output = T> + Send>>);

impl<T> Future for BufferFuture<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.0.as_mut().poll(cx)
    }
}

impl<T> std::fmt::Debug for BufferFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BufferFuture")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[tokio::test]
    async fn reads_a_body_within_the_limit() {
        let body = Full::new(Bytes::from_static(b"hello"));
        let read = read_body(Some(5), body, 5, Duration::from_secs(1)).await;
        assert_eq!(read, Ok(Bytes::from_static(b"hello")));
    }

    #[tokio::test]
    async fn refuses_a_declared_or_actual_body_over_the_limit() {
        let body = || Full::new(Bytes::from_static(b"hello"));
        let declared = read_body(Some(6), body(), 5, Duration::from_secs(1)).await;
        assert_eq!(declared, Err(BodyReadError::TooLarge));
        let actual = read_body(None, body(), 4, Duration::from_secs(1)).await;
        assert_eq!(actual, Err(BodyReadError::TooLarge));
    }

    /// A body whose next byte never comes (a client that stopped sending).
    struct Stalled;

    impl Body for Stalled {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
            Poll::Pending
        }
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_on_a_body_that_never_ends() {
        let read = read_body(None, Stalled, 5, Duration::from_secs(1)).await;
        assert_eq!(read, Err(BodyReadError::Timeout));
    }
}
