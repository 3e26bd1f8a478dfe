//! What the replay layer does with one request, step by step: admit it, read it, look
//! its key up, then replay the record or run the request and store its response.

use std::future::Future;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::request::Parts;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower_service::Service;

use super::read_now::{read_now, ReadNow};
use crate::buffer::{content_length, read_body, BodyReadError};
use crate::layer::{LockInfo, PassedWithoutKey};
use crate::reject::Rejection;

use super::body::ReplayBody;
use super::fingerprint::{fingerprint, Head};
use super::future::ReplayFuture;
use super::lookup::FoundInMemory;
use super::metrics::ReplayMetrics;
use super::record::Fingerprint;
use super::record::Record;
use super::shared::{Settings, Shared};
use super::store::{RecordKey, StoreError, Stored};
use crate::backend::{RecordFound, ReleaseLease, ReleaseSlot};

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
    mut request: Request<ReqBody>,
) -> Result<Response<ReplayBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    let Some(info) = request.extensions().get::<LockInfo>().cloned() else {
        let (mut parts, body) = request.into_parts();
        if !let_through_unlocked(&mut parts) {
            return Ok(outside_the_lock(&shared));
        }
        // Without a key there is nothing to replay under.
        return Box::pin(run(inner, Request::from_parts(parts, body))).await;
    };
    // Set by the lock's acquisition when it looked for the record (`KeyedLockLayer::
    // replay` on a store kept on the lock's engine); taken, so that no replay layer
    // further in reads them as its own.
    let found = request.extensions_mut().remove::<RecordFound>();
    let named = request.extensions_mut().remove::<RecordKey>();
    let metrics = shared.metrics(info.layer());
    let principal = match admit(&settings, &shared, &info, &request) {
        Ok(principal) => principal,
        Err(rejection) => return Ok(reject(&metrics, rejection)),
    };
    let name = |parts: &Parts| {
        named.unwrap_or_else(|| {
            let (layer, key) = info.layer_and_key();
            RecordKey::new(layer, key, Head::new(parts, principal.as_deref()))
        })
    };
    let read = read_request(&settings, name, request).await;
    let (request, mut lookup) = match read {
        Ok(read) => read,
        Err(rejection) => return Ok(reject(&metrics, rejection)),
    };
    let found = match found {
        Some(RecordFound::Stored(bytes)) => check(&settings, &lookup, Record::from_bytes(&bytes))
            .map_or_else(Found::Refused, Found::Record),
        Some(RecordFound::Absent(release)) => {
            lookup.release = Some(release);
            Found::Nothing
        }
        None => look_up(&settings, &info, &lookup).await,
    };
    match found {
        Found::Record(record) => {
            metrics.replayed.increment(1);
            let (status, headers, body) = record.into_parts();
            Ok(replay(status, headers, body))
        }
        // Boxed: the replay above is the path to keep small (this future is moved
        // into its box whole, whatever path it takes).
        Found::Nothing => {
            Box::pin(run_and_store(
                inner, request, &settings, &metrics, lookup, &info,
            ))
            .await
        }
        Found::Refused(rejection) => Ok(reject(&metrics, rejection)),
        Found::Unknown => Box::pin(run(inner, request)).await,
    }
}

/// Where a request's record is, and what it must match.
struct Lookup {
    key: RecordKey,
    fingerprint: Option<Fingerprint>,
    /// The request body, for a memory store to keep beside the record (see
    /// `MemoryStore::keep`): with the built-in fingerprint only.
    request_body: Option<Bytes>,
    /// The lease's release, when the lock's acquisition found no record: a store may
    /// give the lease back with the record it writes.
    release: Option<ReleaseSlot>,
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

/// Whether a request that holds no key was let through by a lock layer on purpose: one
/// without a key ([`allow_missing_key`](crate::KeyedLockLayer::allow_missing_key)), or
/// one no route matched (it keeps the fallback's answer). It then runs unreplayed.
fn let_through_unlocked(parts: &mut Parts) -> bool {
    if parts.extensions.get::<PassedWithoutKey>().is_some() {
        return true;
    }
    #[cfg(feature = "axum")]
    if crate::key::is_unrouted(parts) {
        return true;
    }
    false
}

/// The answer to a request that reached the replay layer before any lock layer took
/// its key: the replay layer is stacked outside the lock (or without one), where a
/// duplicate in flight would run beside the first and nothing could be stored under a
/// held key. 500, and one `error` log per layer. Not counted: without a lock layer
/// there is no layer name to count it under.
fn outside_the_lock<B: Body>(shared: &Shared) -> Response<ReplayBody<B>> {
    if shared.first_misconfiguration() {
        tracing::error!(
            "replay layer misconfigured: a request reached it holding no key of a lock \
             layer; stack it inside the lock (`KeyedLockLayer::replay`, or \
             `.layer(replay).layer(lock)` on an axum Router); answering 500 (logged once \
             per layer)"
        );
    }
    Rejection::misconfigured("the replay layer does not run under a lock layer's key")
        .into_response()
        .map(ReplayBody::full)
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
        return Err(misconfigured(super::shared::NO_FENCING_TOKENS));
    }
    match &settings.principal {
        Some(principal) => principal(request.extensions())
            .map(Some)
            .ok_or_else(|| misconfigured("the request carries no principal to scope records")),
        None => Ok(None),
    }
}

/// A record the lock layer found in memory: replayed if the request's fingerprint
/// matches. A body that is whole already (buffered, or a `Full`) is read at once and
/// the answer needs no future; otherwise the rest of it is awaited.
pub(crate) fn replay_found_in_memory<ReqBody, ResBody, E>(
    settings: &Arc<Settings>,
    shared: &Arc<Shared>,
    found: FoundInMemory,
    request: Request<ReqBody>,
) -> ReplayFuture<Result<Response<ReplayBody<ResBody>>, E>>
where
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    ResBody: Body + Send + 'static,
    E: Send + 'static,
{
    let limit = settings.max_request_bytes;
    let length = content_length(&request);
    // The request is answered from the record: its body is read for the fingerprint
    // only, and the request is not put together again. Boxed, so that a body read in
    // part here can move on to the future that reads the rest.
    let (parts, body) = request.into_parts();
    let mut body = Box::pin(body);
    let read = match read_now(body.as_mut(), length, limit) {
        ReadNow::Whole(bytes) => Ok(bytes),
        ReadNow::Failed(error) => Err(error),
        ReadNow::Partly(first) => {
            let (settings, shared) = (Arc::clone(settings), Arc::clone(shared));
            return ReplayFuture::new(async move {
                let rest = read_body(None, body, limit - first.len(), settings.read_timeout);
                let read = rest.await.map(|rest| joined(first, rest));
                Ok(answer_found(&settings, &shared, found, &parts, read))
            });
        }
    };
    ReplayFuture::ready(Ok(answer_found(settings, shared, found, &parts, read)))
}

/// The answer to a request whose record was found in memory, once its body is read.
fn answer_found<B: Body>(
    settings: &Settings,
    shared: &Shared,
    found: FoundInMemory,
    parts: &Parts,
    body: Result<Bytes, BodyReadError>,
) -> Response<ReplayBody<B>> {
    let metrics = shared.metrics(found.layer.as_str());
    let body = match body {
        Ok(body) => body,
        Err(error) => return reject(&metrics, error.rejection(settings.max_request_bytes)),
    };
    if !found_matches(settings, &found, parts, &body) {
        let rejection = Rejection::fingerprint_mismatch(settings.mismatch_status);
        return reject(&metrics, rejection);
    }
    metrics.replayed.increment(1);
    let record = &found.record;
    replay(
        record.status(),
        record.headers().clone(),
        record.body().clone(),
    )
}

/// Whether the record found in memory answers the request `parts` with `body`.
fn found_matches(settings: &Settings, found: &FoundInMemory, parts: &Parts, body: &Bytes) -> bool {
    match &found.request_body {
        // In the same scope, so with the same method, path and query: the built-in
        // fingerprint matches exactly when the bodies do.
        Some(stored) if settings.builtin_fingerprint() => stored == body,
        _ => matches(
            settings,
            &found.record,
            fingerprint_of(settings, parts, body).as_ref(),
        ),
    }
}

/// `first` and `rest`, one after the other.
fn joined(first: Bytes, rest: Bytes) -> Bytes {
    if first.is_empty() {
        return rest;
    }
    let mut joined = BytesMut::with_capacity(first.len() + rest.len());
    joined.extend_from_slice(&first);
    joined.extend_from_slice(&rest);
    joined.freeze()
}

/// Reads the request body (for the fingerprint), and names the request's record.
async fn read_request<ReqBody>(
    settings: &Settings,
    name: impl FnOnce(&Parts) -> RecordKey,
    request: Request<ReqBody>,
) -> Result<(Request<ReqBody>, Lookup), Rejection>
where
    ReqBody: Body<Data = Bytes> + From<Bytes>,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (parts, body, fingerprint) = read_fingerprint(settings, request).await?;
    let kept = settings.memory.is_some() && settings.builtin_fingerprint();
    let lookup = Lookup {
        key: name(&parts),
        release: None,
        fingerprint,
        request_body: kept.then(|| body.clone()),
    };
    Ok((Request::from_parts(parts, ReqBody::from(body)), lookup))
}

/// Reads the request body, and takes its fingerprint if the settings ask for one.
async fn read_fingerprint<ReqBody>(
    settings: &Settings,
    request: Request<ReqBody>,
) -> Result<(Parts, Bytes, Option<Fingerprint>), Rejection>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limit = settings.max_request_bytes;
    let length = content_length(&request);
    let (parts, body) = request.into_parts();
    let body = read_body(length, body, limit, settings.read_timeout)
        .await
        .map_err(|error| error.rejection(limit))?;
    let fingerprint = fingerprint_of(settings, &parts, &body);
    Ok((parts, body, fingerprint))
}

/// The request's fingerprint, if the settings ask for one.
fn fingerprint_of(settings: &Settings, parts: &Parts, body: &Bytes) -> Option<Fingerprint> {
    settings
        .fingerprint
        .then(|| match &settings.fingerprint_fn {
            Some(custom) => custom(parts, body),
            None => fingerprint(parts, body),
        })
}

/// Asks the store for the request's record.
async fn look_up(settings: &Settings, info: &LockInfo, lookup: &Lookup) -> Found {
    match with_timeout(settings.store_timeout, settings.store.get(&lookup.key)).await {
        Ok(None) => Found::Nothing,
        Ok(Some(record)) => {
            check(settings, lookup, Ok(record)).map_or_else(Found::Refused, Found::Record)
        }
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

/// A record found for the request: replayed if it matches the request's fingerprint.
/// One the lock's acquisition brought that cannot be read is refused whatever
/// `fail_open` says: the request does not hold its key at the backend, so it must not
/// run.
fn check(
    settings: &Settings,
    lookup: &Lookup,
    record: Result<Record, StoreError>,
) -> Result<Record, Rejection> {
    match record {
        Ok(record) if !matches(settings, &record, lookup.fingerprint.as_ref()) => {
            Err(Rejection::fingerprint_mismatch(settings.mismatch_status))
        }
        Ok(record) => Ok(record),
        Err(error) => {
            tracing::warn!(key = lookup.key.key(), %error, "stored replay record unreadable");
            Err(Rejection::store_unreachable())
        }
    }
}

/// Whether `record` answers a request with `fingerprint` (always, with fingerprints
/// off).
fn matches(settings: &Settings, record: &Record, fingerprint: Option<&Fingerprint>) -> bool {
    !settings.fingerprint || record.fingerprint() == fingerprint
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
    let stored = match (lookup.release, &settings.memory) {
        (Some(release), _) => {
            store_and_release(settings, &lookup.key, record, info, &release).await
        }
        // Kept with the request body, which a retry's is compared with.
        (None, Some(memory)) => {
            memory.keep(&lookup.key, record, settings.ttl, lookup.request_body);
            Some(Stored::Written)
        }
        (None, None) => store(settings, &lookup.key, record, info).await,
    };
    match stored {
        Some(Stored::Written) => metrics.stored.increment(1),
        Some(Stored::Fenced) => tracing::warn!(
            layer = info.layer(),
            "response not stored: the lease was lost and a later holder owns the key"
        ),
        None => {}
    }
    Ok(Response::from_parts(parts, ReplayBody::full(body)))
}

/// A rejection, counted and answered.
fn reject<B: Body>(metrics: &ReplayMetrics, rejection: Rejection) -> Response<ReplayBody<B>> {
    metrics.rejected(rejection.kind());
    rejection.into_response().map(ReplayBody::full)
}

/// Writes the record; what the store did (`None`: it failed, and said why in the log).
async fn store(
    settings: &Settings,
    key: &RecordKey,
    record: Record,
    info: &LockInfo,
) -> Option<Stored> {
    let put = settings
        .store
        .put(key, record, settings.ttl, info.fencing_token());
    finish(info, with_timeout(settings.store_timeout, put)).await
}

/// Writes the record and gives the request's lease back in one step, where the store
/// can: the lease's release is taken from the guard first (so it is not released
/// twice) and its renewal stopped (so that no renewal finds the lock gone). If the
/// store did not release it, the release runs as usual. Both in a task of their own:
/// a request dropped meanwhile leaves neither half done.
async fn store_and_release(
    settings: &Settings,
    key: &RecordKey,
    record: Record,
    info: &LockInfo,
    release: &ReleaseSlot,
) -> Option<Stored> {
    // A lease cut off by a shutdown meanwhile (its slot empty), or a store that cannot:
    // a plain write, the lease (if still held) released by the guard after it.
    let taken = info
        .fencing_token()
        .and_then(|token| put_and_release(settings, key, &record, token, release));
    let Some((put, release)) = taken else {
        return store(settings, key, record, info).await;
    };
    release.stop_renewal();
    let put = with_timeout(settings.store_timeout, put);
    finish(info, async move {
        let stored = put.await;
        if !matches!(stored, Ok(Stored::Written)) {
            release.release().await;
        }
        stored
    })
    .await
}

/// The store's write that releases the lease too, and the release taken out of its
/// slot for it; `None` with the slot as it was when the store cannot. Under the slot's
/// lock, so that a shutdown's cut-off cannot take the release midway; once taken out,
/// dropping it would unlock.
fn put_and_release(
    settings: &Settings,
    key: &RecordKey,
    record: &Record,
    token: u64,
    slot: &ReleaseSlot,
) -> Option<(super::store::Put, Box<dyn ReleaseLease>)> {
    let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
    let release = slot.take()?;
    match settings
        .store
        .put_and_release(key, record, settings.ttl, token, &*release)
    {
        Some(put) => Some((put, release)),
        None => {
            *slot = Some(release);
            None
        }
    }
}

/// Runs `write` in a task of its own (a dropped request does not cut it off midway)
/// and waits for it: what it stored, or `None` (it failed, and the log says why).
async fn finish(
    info: &LockInfo,
    write: impl Future<Output = Result<Stored, StoreError>> + Send + 'static,
) -> Option<Stored> {
    match tokio::spawn(write).await {
        Ok(Ok(stored)) => Some(stored),
        Ok(Err(error)) => {
            tracing::warn!(layer = info.layer(), %error, "response not stored");
            None
        }
        Err(error) => {
            tracing::warn!(layer = info.layer(), %error, "response not stored");
            None
        }
    }
}

/// A store call within `limit` (a store in memory answers without a timer).
async fn with_timeout<T>(
    limit: Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    crate::within::within(limit, call)
        .await
        .unwrap_or_else(|| Err(StoreError::timeout(limit)))
}

/// The stored response, marked as a replay.
fn replay<B: Body>(
    status: StatusCode,
    mut headers: HeaderMap,
    body: Bytes,
) -> Response<ReplayBody<B>> {
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let mut response = Response::new(ReplayBody::full(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
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
