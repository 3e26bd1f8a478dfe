//! [`KeyedLock`]: the service made by [`KeyedLockLayer`](crate::KeyedLockLayer).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use http::request::Parts;
use http::{Request, Response};
use tower_service::Service;

use super::body::KeyedLockBody;
use super::future::{Pending, ResponseFuture, WaitTicket};
use super::held::HeldKey;
use super::info::LockInfo;
use super::look_first::LookFirst;
use super::shared::Shared;
use super::trace;
use crate::backend::RecordLookup;
use crate::distributed::DistributedAcquire;
use crate::error::LockError;
use crate::key::{Key, KeyExtractor};
use crate::locks::Mode;

/// Serializes requests per key around the inner service `S`; made by
/// [`KeyedLockLayer`](crate::KeyedLockLayer).
pub struct KeyedLock<S, E> {
    inner: S,
    extractor: E,
    shared: Arc<Shared>,
    /// The look before the key is taken (`KeyedLockLayer::replay`: the request's
    /// replay record, at the backend or in memory).
    look_first: Option<Arc<dyn LookFirst>>,
}

impl<S, E> KeyedLock<S, E> {
    pub(crate) fn new(inner: S, extractor: E, shared: Arc<Shared>) -> Self {
        Self {
            inner,
            extractor,
            shared,
            look_first: None,
        }
    }

    #[cfg(feature = "replay")]
    pub(crate) fn looking_first(mut self, look: Arc<dyn LookFirst>) -> Self {
        self.look_first = Some(look);
        self
    }

    inner_service_accessors!();
}

impl<S: Clone, E> KeyedLock<S, E> {
    /// Takes the inner service, with whatever readiness it reserved so far, for a
    /// future that readies and calls it later, leaving a fresh clone for the next
    /// request.
    fn take_inner(&mut self) -> S {
        let fresh = self.inner.clone();
        std::mem::replace(&mut self.inner, fresh)
    }
}

impl<S, E, ReqBody, ResBody> Service<Request<ReqBody>> for KeyedLock<S, E>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    E: KeyExtractor,
{
    type Response = Response<KeyedLockBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    /// Always ready: the inner service is readied only once the request holds its key,
    /// so a request waiting for a key never holds the inner service's capacity (a
    /// `ConcurrencyLimit` permit, a `Buffer` slot) that requests for other keys need.
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let shared = &self.shared;
        let (mut parts, body) = request.into_parts();
        #[cfg(feature = "axum")]
        if crate::key::is_unrouted(&mut parts) {
            return self.pass_through(Request::from_parts(parts, body));
        }
        let key = match self.extractor.extract_key(&mut parts, shared.max_key_len) {
            Ok(key) => key,
            Err(error) if error.is_absent() && shared.config.allow_missing_key => {
                // Tells a replay layer inside that a lock layer let it through.
                #[cfg(feature = "replay")]
                parts.extensions.insert(super::info::PassedWithoutKey);
                return self.pass_through(Request::from_parts(parts, body));
            }
            Err(error) => {
                return ResponseFuture::rejected(shared.respond(shared.key_rejection(&error)))
            }
        };
        let reentered = parts.extensions.get::<LockInfo>();
        if reentered.is_some_and(|info| info.holds(&shared.tag, &key)) {
            // The same layer value, applied again on this request's path, already holds
            // the key for it: waiting would be waiting for itself.
            return self.pass_through(Request::from_parts(parts, body));
        }

        // Registers the metrics (and the key gauge) before the table is first touched.
        let shared = shared.clone();
        shared.metrics();
        if shared.locks.is_shutting_down() {
            let rejection = shared.lock_rejection(&LockError::ShuttingDown);
            return ResponseFuture::rejected(shared.respond(rejection));
        }
        let mode = shared.config.mode_for(&parts.method);
        if shared.locks.is_distributed() {
            let lookup = self.record_lookup(&shared, &mut parts, &key, mode);
            // In the request's mode: the backend then holds it the same way (the layer
            // refused a backend that cannot when it was applied).
            let local = match mode {
                Mode::Shared => shared.locks.local().try_lock_shared(key.clone()),
                Mode::Exclusive => shared.locks.local().try_lock(key.clone()),
            };
            return match local {
                // Held here; now the backend.
                Ok(local) => {
                    let span = trace::wait_span(&shared, &parts.extensions, &key);
                    let timeout = Some(shared.config.wait_timeout);
                    let acquire = shared.locks.after_local(local, timeout, lookup);
                    let request = Request::from_parts(parts, body);
                    self.wait(acquire, request, shared, false, span)
                }
                Err(error) => {
                    let request = Request::from_parts(parts, body);
                    self.contended(error, (key, mode, lookup), request, shared)
                }
            };
        }
        if self.found_in_memory(&shared, &mut parts, &key, mode) {
            // A completed request, replayed from memory: it needs no key.
            return self.pass_through(Request::from_parts(parts, body));
        }
        // Uncontended: take the key now and call the inner service at once, with no
        // clock read for the wait, no timer and no service clone.
        let hold = match shared.locks.local().try_hold(&key, mode) {
            Ok(hold) => hold,
            Err(error) => {
                let request = Request::from_parts(parts, body);
                return self.contended(error, (key, mode, None), request, shared);
            }
        };
        let is_shared = mode == Mode::Shared;
        let span = trace::hold_span(&shared, &parts.extensions, &key, is_shared, None);
        let held = HeldKey::local(hold, &key, shared, span);
        let shared = held.shared();
        let metrics = shared.metrics();
        metrics.acquired_uncontended.increment(1);
        metrics.wait_acquired.record(0.0);
        LockInfo::local(&shared.tag, key, is_shared).insert_into(&mut parts.extensions);
        self.ready_and_call(Request::from_parts(parts, body), Some(held))
    }
}

impl<S, E> KeyedLock<S, E> {
    /// The key is busy (or a limit was reached): wait for it, or answer at once. Out of
    /// line, like `wait`: the uncontended path is the one to keep short.
    #[cold]
    #[inline(never)]
    fn contended<ReqBody, ResBody>(
        &mut self,
        error: LockError,
        (key, mode, lookup): (Key, Mode, Option<RecordLookup>),
        request: Request<ReqBody>,
        shared: Arc<Shared>,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    {
        let busy = matches!(error, LockError::Busy);
        if !busy || shared.config.wait_timeout.is_zero() {
            if busy {
                shared.metrics().wait_timeout.record(0.0);
            }
            return ResponseFuture::rejected(shared.respond(shared.lock_rejection(&error)));
        }
        let span = trace::wait_span(&shared, request.extensions(), &key);
        let timeout = Some(shared.config.wait_timeout);
        let acquire = shared.locks.acquire(key, timeout, mode, lookup);
        self.wait(acquire, request, shared, true, span)
    }

    /// Waits for the key (`contended`: behind a holder in this process; else at the
    /// backend only), then readies a clone of the inner service and calls it.
    #[inline(never)]
    fn wait<ReqBody, ResBody>(
        &mut self,
        acquire: DistributedAcquire,
        request: Request<ReqBody>,
        shared: Arc<Shared>,
        contended: bool,
        span: tracing::Span,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    {
        let service = self.inner.clone();
        let ticket = WaitTicket::new(shared, contended, span);
        let pending = Pending::new(service, request, ticket);
        ResponseFuture::acquiring(acquire, pending)
    }
}

impl<S, E> KeyedLock<S, E> {
    /// The replay record an exclusive request's remote acquisition looks for first,
    /// when the layer was stacked with [`replay`](crate::KeyedLockLayer::replay) on a
    /// store kept on the lock's engine.
    fn record_lookup(
        &self,
        shared: &Shared,
        parts: &mut Parts,
        key: &Key,
        mode: Mode,
    ) -> Option<RecordLookup> {
        match (&self.look_first, mode) {
            (Some(look), Mode::Exclusive) => look.lookup(parts, shared.tag.name(), key),
            _ => None,
        }
    }

    /// Whether an exclusive request's replay record is in the memory store of the
    /// replay layer stacked with [`replay`](crate::KeyedLockLayer::replay): then the
    /// replay layer replays it, and the request takes no key.
    fn found_in_memory(&self, shared: &Shared, parts: &mut Parts, key: &Key, mode: Mode) -> bool {
        match (&self.look_first, mode) {
            (Some(look), Mode::Exclusive) => look.found_in_memory(parts, shared.tag.name(), key),
            _ => false,
        }
    }
}

impl<S, E> KeyedLock<S, E> {
    /// Calls the inner service without a lock (no key, or an unrouted request, or one
    /// that already holds its key here).
    fn pass_through<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    {
        self.ready_and_call(request, None)
    }

    /// Readies the inner service for a request that may run now (under `held`, or
    /// without a lock), then calls it. One try without a waker first: a service that is
    /// ready at once (axum's `Router` always is) is called here, with no clone; any
    /// other goes to the future with what it reserved so far, and the future readies it
    /// with the task's waker.
    #[inline]
    fn ready_and_call<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
        held: Option<HeldKey>,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    {
        // The handler's own spans, made in `call`, nest in the hold span.
        let entered = held.as_ref().and_then(HeldKey::enter);
        match self
            .inner
            .poll_ready(&mut Context::from_waker(Waker::noop()))
        {
            Poll::Ready(Ok(())) => {
                let future = self.inner.call(request);
                drop(entered);
                ResponseFuture::running(future, held)
            }
            Poll::Ready(Err(error)) => ResponseFuture::failed(error),
            Poll::Pending => {
                drop(entered);
                ResponseFuture::readying(self.take_inner(), request, held, None)
            }
        }
    }
}

impl<S: Clone, E: Clone> Clone for KeyedLock<S, E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            extractor: self.extractor.clone(),
            shared: self.shared.clone(),
            look_first: self.look_first.clone(),
        }
    }
}

impl<S: fmt::Debug, E: fmt::Debug> fmt::Debug for KeyedLock<S, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLock")
            .field("inner", &self.inner)
            .field("extractor", &self.extractor)
            .field("active_keys", &self.shared.locks.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    //! The rules of DESIGN.md's "Semantics" that concern the inner service, driven with
    //! `ServiceExt::oneshot` on a plain tower stack.

    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use http::{Request, Response};
    use tokio::sync::Notify;
    use tower::limit::ConcurrencyLimitLayer;
    use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};

    use crate::KeyedLockLayer;

    fn request(key: &str) -> Request<()> {
        Request::builder().header("x-key", key).body(()).unwrap()
    }

    /// A handler that runs until `release` is notified when its key is "a-slow".
    fn handler(
        calls: Arc<AtomicUsize>,
        release: Arc<Notify>,
    ) -> impl tower::Service<
        Request<()>,
        Response = Response<http_body_util::Empty<bytes::Bytes>>,
        Error = Infallible,
        Future = impl Send,
    > + Clone {
        service_fn(move |request: Request<()>| {
            let (calls, release) = (calls.clone(), release.clone());
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                if request.headers()["x-key"] == "a" {
                    release.notified().await;
                }
                Ok::<_, Infallible>(Response::new(http_body_util::Empty::new()))
            }
        })
    }

    #[tokio::test]
    async fn a_waiter_holds_no_capacity_of_the_inner_service() {
        let calls = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        // Two requests at a time inside the lock: one holder of "a" and one waiter for
        // "a" must leave the second place to a request for "b".
        let service = ServiceBuilder::new()
            .layer(KeyedLockLayer::by_header("x-key"))
            .layer(ConcurrencyLimitLayer::new(2))
            .service(handler(calls.clone(), release.clone()));

        let holder = tokio::spawn(service.clone().oneshot(request("a")));
        let waiter = tokio::spawn(service.clone().oneshot(request("a")));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1, "only the holder of a runs");

        let other = tokio::time::timeout(Duration::from_secs(1), service.oneshot(request("b")))
            .await
            .expect("b must not wait for a's waiter");
        assert_eq!(other.unwrap().status(), 200);

        release.notify_one();
        holder.await.unwrap().unwrap();
        release.notify_one();
        waiter.await.unwrap().unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn the_inner_service_is_readied_and_called_only_after_the_key_is_held() {
        let readied = Arc::new(AtomicUsize::new(0));
        let calls = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        let counted = {
            let readied = readied.clone();
            tower::layer::layer_fn(move |inner| Readied {
                inner,
                readied: readied.clone(),
            })
        };
        let mut service = KeyedLockLayer::by_header("x-key")
            .layer(counted.layer(handler(calls.clone(), release.clone())));

        // The layer's own readiness reserves nothing inside.
        service.ready().await.unwrap();
        assert_eq!(readied.load(Ordering::SeqCst), 0);

        let holder = tokio::spawn(service.clone().oneshot(request("a")));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            (readied.load(Ordering::SeqCst), calls.load(Ordering::SeqCst)),
            (1, 1)
        );

        let waiter = tokio::spawn(service.clone().oneshot(request("a")));
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Waiting for the key: the inner service is neither readied nor called.
        assert_eq!(
            (readied.load(Ordering::SeqCst), calls.load(Ordering::SeqCst)),
            (1, 1)
        );

        release.notify_one();
        holder.await.unwrap().unwrap();
        release.notify_one();
        waiter.await.unwrap().unwrap();
        assert_eq!(
            (readied.load(Ordering::SeqCst), calls.load(Ordering::SeqCst)),
            (2, 2)
        );
    }

    #[tokio::test]
    async fn rejections_are_ok_responses_with_problem_json() {
        let calls = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        let layer = KeyedLockLayer::by_header("x-key").wait_timeout(Duration::ZERO);
        let service = layer.layer(handler(calls.clone(), release.clone()));

        let holder = tokio::spawn(service.clone().oneshot(request("a")));
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Busy key, no wait: the timeout status, with Retry-After, not an `Err`.
        let busy = service.clone().oneshot(request("a")).await.unwrap();
        assert_eq!(busy.status(), 409);
        assert_eq!(busy.headers()["content-type"], "application/problem+json");
        assert!(busy.headers().contains_key("retry-after"));
        // No key: 400, nothing to retry after.
        let missing = service.oneshot(Request::new(())).await.unwrap();
        assert_eq!(missing.status(), 400);
        assert!(!missing.headers().contains_key("retry-after"));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "only the holder ran");

        release.notify_one();
        holder.await.unwrap().unwrap();
        assert_eq!(layer.active_keys(), 0);
    }

    #[tokio::test]
    async fn a_full_queue_answers_429_and_a_dropped_waiter_leaves_nothing_behind() {
        let calls = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Notify::new());
        let layer = KeyedLockLayer::by_header("x-key").max_waiters(1);
        let service = layer.layer(handler(calls.clone(), release.clone()));

        let holder = tokio::spawn(service.clone().oneshot(request("a")));
        let waiter = tokio::spawn(service.clone().oneshot(request("a")));
        tokio::time::sleep(Duration::from_millis(20)).await;
        let over = service.clone().oneshot(request("a")).await.unwrap();
        assert_eq!(over.status(), 429);
        assert!(over.headers().contains_key("retry-after"));

        // The waiter's client goes away: its place and the key's entry go with it.
        waiter.abort();
        assert!(waiter.await.unwrap_err().is_cancelled());
        release.notify_one();
        holder.await.unwrap().unwrap();
        assert_eq!(layer.active_keys(), 0);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn waiters_for_a_key_run_in_arrival_order() {
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let release = Arc::new(Notify::new());
        let inner = {
            let (order, release) = (order.clone(), release.clone());
            service_fn(move |request: Request<()>| {
                let (order, release) = (order.clone(), release.clone());
                async move {
                    let id = request.headers()["x-id"].to_str().unwrap().to_owned();
                    order.lock().unwrap().push(id);
                    release.notified().await;
                    Ok::<_, Infallible>(Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
                }
            })
        };
        let service = KeyedLockLayer::by_header("x-key").layer(inner);
        let mut requests = Vec::new();
        for id in 0..4 {
            let request = Request::builder()
                .header("x-key", "a")
                .header("x-id", id.to_string())
                .body(())
                .unwrap();
            requests.push(tokio::spawn(service.clone().oneshot(request)));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for request in requests {
            release.notify_one();
            request.await.unwrap().unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["0", "1", "2", "3"]);
    }

    /// Counts the times its inner service is readied.
    #[derive(Clone)]
    struct Readied<S> {
        inner: S,
        readied: Arc<AtomicUsize>,
    }

    impl<S: tower::Service<R>, R> tower::Service<R> for Readied<S> {
        type Response = S::Response;
        type Error = S::Error;
        type Future = S::Future;

        fn poll_ready(
            &mut self,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), S::Error>> {
            let ready = self.inner.poll_ready(cx);
            if ready.is_ready() {
                self.readied.fetch_add(1, Ordering::SeqCst);
            }
            ready
        }

        fn call(&mut self, request: R) -> S::Future {
            self.inner.call(request)
        }
    }
}
