//! What the replay layer does with one request, step by step: admit it, read it, look
//! its key up, then replay the record or run the request and store its response.

use std::future::Future;
use std::sync::Arc;
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
use super::metrics::ReplayMetrics;
use super::record::Fingerprint;
use super::record::Record;
use super::shared::{Settings, Shared};
use super::store::{RecordKey, StoreError, Stored};

/// The header a replayed response carries.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

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

/// Answers one request: the replay layer's whole job, in its steps.
pub(crate) async fn respond<S, ReqBody, ResBody>(
    inner: S,
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
        return run(inner, request).await;
    };
    let metrics = shared.metrics(info.layer());
    let principal = match admit(&settings, &shared, &info, &request) {
        Ok(principal) => principal,
        Err(rejection) => return Ok(reject(&metrics, rejection)),
    };
    let (request, lookup) = match read_request(&settings, &info, principal, request).await {
        Ok(read) => read,
        Err(rejection) => return Ok(reject(&metrics, rejection)),
    };
    match look_up(&settings, &info, &lookup).await {
        Found::Record(record) => {
            metrics.replayed.increment(1);
            Ok(replay(record))
        }
        Found::Nothing => run_and_store(inner, request, &settings, &metrics, lookup, &info).await,
        Found::Refused(rejection) => Ok(reject(&metrics, rejection)),
        Found::Unknown => run(inner, request).await,
    }
}

/// Where a request's record is, and what it must match.
struct Lookup {
    key: RecordKey,
    fingerprint: Option<Fingerprint>,
}

/// What the store had for a request.
enum Found {
    /// A record this request may replay.
    Record(Record),
    /// No record: run the request and store its response.
    Nothing,
    /// A record for another request, or a store that could not be read (fail closed).
    Refused(Rejection),
    /// The store could not be read and the layer fails open: run without replay.
    Unknown,
}

/// Whether the layers are set up so that replay can work for this request; its
/// principal, if records are scoped by one.
fn admit<B>(
    settings: &Settings,
    shared: &Shared,
    info: &LockInfo,
    request: &Request<B>,
) -> Result<Option<String>, Rejection> {
    let misconfigured = |detail: &'static str| {
        if shared.first_misconfiguration() {
            tracing::error!(layer = info.layer(), "replay layer misconfigured: {detail}");
        }
        Rejection::misconfigured(detail)
    };
    if info.lease().is_some() && settings.store.is_per_instance() {
        return Err(misconfigured(
            "a per-instance replay store is used under a distributed lock; \
             use a shared store (Redis, PostgreSQL)",
        ));
    }
    if info.lease().is_some()
        && info.fencing_token().is_none()
        && settings.store.needs_fencing_tokens()
    {
        return Err(misconfigured(super::layer::NO_FENCING_TOKENS));
    }
    match &settings.principal {
        Some(principal) => principal(request.extensions())
            .map(Some)
            .ok_or_else(|| misconfigured("the request carries no principal to scope records")),
        None => Ok(None),
    }
}

/// Reads the request body (for the fingerprint), and names the request's record.
async fn read_request<ReqBody>(
    settings: &Settings,
    info: &LockInfo,
    principal: Option<String>,
    request: Request<ReqBody>,
) -> Result<(Request<ReqBody>, Lookup), Rejection>
where
    ReqBody: Body<Data = Bytes> + From<Bytes>,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limit = settings.max_request_bytes;
    let length = content_length(&request);
    let (parts, body) = request.into_parts();
    let body = read_body(length, body, limit, settings.read_timeout)
        .await
        .map_err(|error| error.rejection(limit))?;
    let lookup = Lookup {
        key: RecordKey::new(
            info.layer(),
            info.key(),
            scope(&parts, principal.as_deref()),
        ),
        fingerprint: settings
            .fingerprint
            .then(|| match &settings.fingerprint_fn {
                Some(custom) => custom(&parts, &body),
                None => fingerprint(&parts, &body),
            }),
    };
    Ok((Request::from_parts(parts, ReqBody::from(body)), lookup))
}

/// Asks the store for the request's record.
async fn look_up(settings: &Settings, info: &LockInfo, lookup: &Lookup) -> Found {
    match with_timeout(settings.store_timeout, settings.store.get(&lookup.key)).await {
        Ok(None) => Found::Nothing,
        Ok(Some(record))
            if settings.fingerprint && record.fingerprint() != lookup.fingerprint.as_ref() =>
        {
            Found::Refused(Rejection::fingerprint_mismatch(settings.mismatch_status))
        }
        Ok(Some(record)) => Found::Record(record),
        Err(error) if settings.fail_open => {
            tracing::warn!(layer = info.layer(), %error, "replay store unreachable, running without replay");
            Found::Unknown
        }
        Err(error) => {
            tracing::warn!(layer = info.layer(), %error, "replay store unreachable");
            Found::Refused(Rejection::store_unreachable())
        }
    }
}

/// Runs the request without replay and without storing.
async fn run<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ReplayBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body,
{
    let response = inner.call(request).await?;
    Ok(response.map(ReplayBody::inner))
}

/// Runs the request and stores its response, if it may be stored and fits.
async fn run_and_store<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<ReqBody>,
    settings: &Settings,
    metrics: &ReplayMetrics,
    lookup: Lookup,
    info: &LockInfo,
) -> Result<Response<ReplayBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
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
        lookup.fingerprint,
        parts.status,
        &parts.headers,
        &settings.replayed_headers,
        body.clone(),
    );
    store(settings, metrics, &lookup.key, record, info).await;
    Ok(Response::from_parts(parts, ReplayBody::full(body)))
}

/// A rejection, counted and answered.
fn reject<B: Body>(metrics: &ReplayMetrics, rejection: Rejection) -> Response<ReplayBody<B>> {
    metrics.rejected(rejection.kind());
    rejection.into_response().map(ReplayBody::full)
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
