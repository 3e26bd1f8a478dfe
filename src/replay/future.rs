//! What the replay layer does with one request: look up, replay or run, then store.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower_service::Service;

use crate::buffer::{content_length, read_body};
use crate::layer::LockInfo;
use crate::reject::Rejection;

use super::body::ReplayBody;
use super::fingerprint::{fingerprint, scope};
use super::layer::{Settings, Shared};
use super::metrics::ReplayMetrics;
use super::record::Record;
use super::store::{RecordKey, StoreError, Stored};

/// The header a replayed response carries.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response future of [`Replay`](super::Replay).
///
/// Dropping it at any await (a client that went away) stores nothing unless the
/// inner service already answered: the store write runs in a task of its own, so a
/// completed handler's record is not lost to a disconnect in the last round trip.
pub struct ReplayFuture<T>(Pin<Box<dyn Future<Output = T> + Send>>);

impl<T> ReplayFuture<T> {
    pub(crate) fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        Self(Box::pin(future))
    }
}

impl<T> Future for ReplayFuture<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.0.as_mut().poll(cx)
    }
}

impl<T> std::fmt::Debug for ReplayFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplayFuture")
    }
}

/// Whether a response with `status` is stored: not 401, 403, 408, 409 or 429 (they
/// depend on the moment or on credentials), and not 5xx unless asked for.
pub(crate) fn is_storable(status: StatusCode, store_server_errors: bool) -> bool {
    let transient = [
        StatusCode::UNAUTHORIZED,
        StatusCode::FORBIDDEN,
        StatusCode::REQUEST_TIMEOUT,
        StatusCode::CONFLICT,
        StatusCode::TOO_MANY_REQUESTS,
    ];
    !transient.contains(&status)
        && !status.is_informational()
        && (store_server_errors || !status.is_server_error())
}

pub(crate) async fn respond<S, ReqBody, ResBody>(
    mut inner: S,
    settings: Arc<Settings>,
    shared: Arc<Shared>,
    request: Request<ReqBody>,
) -> Result<Response<ReplayBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    // Without a key (the lock layer let the request through unlocked) there is
    // nothing to replay under.
    let Some(info) = request.extensions().get::<LockInfo>().cloned() else {
        let response = inner.call(request).await?;
        return Ok(response.map(ReplayBody::inner));
    };
    let metrics = shared.metrics(info.layer());
    let reject = |rejection: Rejection| {
        metrics.rejected(rejection.kind());
        Ok(rejection.into_response().map(ReplayBody::full))
    };
    let misconfigured = |detail: &'static str| {
        if shared.first_misconfiguration() {
            tracing::error!(layer = info.layer(), "replay layer misconfigured: {detail}");
        }
        reject(Rejection::misconfigured(detail))
    };

    if info.lease().is_some() && settings.store.is_per_instance() {
        return misconfigured(
            "a per-instance replay store is used under a distributed lock; \
             use a shared store (Redis, PostgreSQL)",
        );
    }
    let principal = match &settings.principal {
        Some(principal) => match principal(request.extensions()) {
            Some(principal) => Some(principal),
            None => return misconfigured("the request carries no principal to scope records"),
        },
        None => None,
    };

    let length = content_length(&request);
    let (parts, body) = request.into_parts();
    let body = match read_body(
        length,
        body,
        settings.max_request_bytes,
        settings.read_timeout,
    )
    .await
    {
        Ok(body) => body,
        Err(error) => return reject(error.rejection(settings.max_request_bytes)),
    };
    let record_key = RecordKey::new(
        info.layer(),
        info.key(),
        scope(&parts, principal.as_deref()),
    );
    let fingerprint = settings.fingerprint.then(|| fingerprint(&parts, &body));
    let request = Request::from_parts(parts, ReqBody::from(body));

    let stored = match with_timeout(settings.store_timeout, settings.store.get(&record_key)).await {
        Ok(stored) => stored,
        Err(error) if settings.fail_open => {
            tracing::warn!(layer = info.layer(), %error, "replay store unreachable, running without replay");
            let response = inner.call(request).await?;
            return Ok(response.map(ReplayBody::inner));
        }
        Err(error) => {
            tracing::warn!(layer = info.layer(), %error, "replay store unreachable");
            return reject(Rejection::store_unreachable());
        }
    };
    if let Some(record) = stored {
        if settings.fingerprint && record.fingerprint() != fingerprint.as_ref() {
            return reject(Rejection::fingerprint_mismatch(settings.mismatch_status));
        }
        metrics.replayed.increment(1);
        return Ok(replay(record));
    }

    let response = inner.call(request).await?;
    if !is_storable(response.status(), settings.store_server_errors) {
        return Ok(response.map(ReplayBody::inner));
    }
    let (parts, body) = response.into_parts();
    let body = match read_response(body, settings.max_response_bytes).await {
        ResponseBody::Whole(body) => body,
        ResponseBody::Unstorable(body) => return Ok(Response::from_parts(parts, body)),
    };
    let record = Record::new(
        fingerprint,
        parts.status,
        &parts.headers,
        &settings.replayed_headers,
        body.clone(),
    );
    store(&settings, metrics, &record_key, record, &info).await;
    Ok(Response::from_parts(parts, ReplayBody::full(body)))
}

/// Writes the record in a task of its own and waits for it.
async fn store(
    settings: &Settings,
    metrics: &ReplayMetrics,
    key: &RecordKey,
    record: Record,
    info: &LockInfo,
) {
    let put = settings
        .store
        .put(key, record, settings.ttl, info.fencing_token());
    let put = tokio::spawn(with_timeout(settings.store_timeout, put));
    match put.await {
        Ok(Ok(Stored::Written)) => metrics.stored.increment(1),
        Ok(Ok(Stored::Fenced)) => tracing::warn!(
            layer = info.layer(),
            "response not stored: the lease was lost and a later holder owns the key"
        ),
        Ok(Err(error)) => tracing::warn!(layer = info.layer(), %error, "response not stored"),
        Err(error) => tracing::warn!(layer = info.layer(), %error, "response not stored"),
    }
}

async fn with_timeout<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, call)
        .await
        .unwrap_or_else(|_| Err(StoreError::timeout(limit)))
}

/// The stored response, marked as a replay.
fn replay<B: Body>(record: Record) -> Response<ReplayBody<B>> {
    let mut response = Response::new(ReplayBody::full(record.body().clone()));
    *response.status_mut() = record.status();
    let headers = response.headers_mut();
    headers.extend(record.headers().clone());
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

enum ResponseBody<B: Body> {
    /// Read to its end within the limit: store it.
    Whole(Bytes),
    /// Over the limit, with trailers, or broken: pass it on as it comes.
    Unstorable(ReplayBody<B>),
}

/// Reads the response body up to `limit` bytes.
async fn read_response<B: Body<Data = Bytes>>(body: B, limit: usize) -> ResponseBody<B> {
    if body.size_hint().lower() > limit as u64 {
        return ResponseBody::Unstorable(ReplayBody::inner(body));
    }
    let mut body = Box::pin(body);
    let mut head = BytesMut::new();
    loop {
        let frame = match body.frame().await {
            None => return ResponseBody::Whole(head.freeze()),
            Some(Ok(frame)) => frame,
            Some(Err(error)) => {
                return ResponseBody::Unstorable(ReplayBody::partial(
                    head.freeze(),
                    Some(Err(error)),
                    None,
                ));
            }
        };
        match frame.into_data() {
            Ok(data) if head.len() + data.len() <= limit => head.extend_from_slice(&data),
            Ok(data) => {
                let next = Some(Ok(Frame::data(data)));
                return ResponseBody::Unstorable(ReplayBody::partial(
                    head.freeze(),
                    next,
                    Some(body),
                ));
            }
            Err(trailers) => {
                let next = Some(Ok(trailers));
                return ResponseBody::Unstorable(ReplayBody::partial(
                    head.freeze(),
                    next,
                    Some(body),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storable_statuses() {
        for (status, stored) in [
            (200, true),
            (201, true),
            (204, true),
            (302, true),
            (400, true),
            (404, true),
            (422, true),
            (401, false),
            (403, false),
            (408, false),
            (409, false),
            (429, false),
            (500, false),
            (503, false),
        ] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(is_storable(status, false), stored, "{status}");
        }
        assert!(is_storable(StatusCode::INTERNAL_SERVER_ERROR, true));
        assert!(!is_storable(StatusCode::TOO_MANY_REQUESTS, true));
    }
}
