//! [`KeyedLock`]: the service made by [`KeyedLockLayer`](crate::KeyedLockLayer).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tower_service::Service;

use super::body::KeyedLockBody;
use super::future::{Pending, ResponseFuture, WaitTicket};
use super::held::HeldKey;
use super::info::LockInfo;
use super::shared::Shared;
use crate::distributed::DistributedAcquire;
use crate::key::{Key, KeyExtractor};
use crate::locks::LockError;

/// Serializes requests per key around the inner service `S`; made by
/// [`KeyedLockLayer`](crate::KeyedLockLayer).
pub struct KeyedLock<S, E> {
    inner: S,
    extractor: E,
    shared: Arc<Shared>,
}

impl<S, E> KeyedLock<S, E> {
    pub(crate) fn new(inner: S, extractor: E, shared: Arc<Shared>) -> Self {
        Self {
            inner,
            extractor,
            shared,
        }
    }
}

impl<S: Clone, E> KeyedLock<S, E> {
    /// Takes the service `poll_ready` readied, for a request that calls it later,
    /// leaving a fresh clone for the next request.
    fn take_ready(&mut self) -> S {
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

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let shared = &self.shared;
        let (mut parts, body) = request.into_parts();
        #[cfg(feature = "axum")]
        if crate::key::is_unrouted(&mut parts) {
            return self.pass_through(Request::from_parts(parts, body));
        }
        let key = match self
            .extractor
            .extract_key(&mut parts, shared.config.max_key_len)
        {
            Ok(key) => key,
            Err(error) if error.is_absent() && shared.config.allow_missing_key => {
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
        if shared.locks.is_distributed() {
            return match shared.locks.local().try_lock(key.clone()) {
                // Held here; now the backend.
                Ok(local) => {
                    let timeout = Some(shared.config.wait_timeout);
                    let acquire = shared.locks.after_local(local, timeout);
                    self.wait(acquire, Request::from_parts(parts, body), shared, false)
                }
                Err(error) => self.contended(error, key, Request::from_parts(parts, body), shared),
            };
        }
        // Uncontended: take the key now and call the inner service at once, with no
        // clock read for the wait, no timer and no service clone.
        let held = match shared.locks.local().try_hold(&key) {
            Ok(hold) => HeldKey::local(hold, &key, shared),
            Err(error) => {
                return self.contended(error, key, Request::from_parts(parts, body), shared)
            }
        };
        let shared = held.shared();
        let metrics = shared.metrics();
        metrics.acquired_uncontended.increment(1);
        metrics.wait_acquired.record(0.0);
        LockInfo::new(&shared.tag, key, Duration::ZERO, None, None)
            .insert_into(&mut parts.extensions);
        ResponseFuture::running(
            self.inner.call(Request::from_parts(parts, body)),
            Some(held),
        )
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
        key: Key,
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
        let acquire = shared.locks.acquire(key, Some(shared.config.wait_timeout));
        self.wait(acquire, request, shared, true)
    }

    /// Waits for the key (`contended`: behind a holder in this process; else at the
    /// backend only), then calls the readied service.
    #[inline(never)]
    fn wait<ReqBody, ResBody>(
        &mut self,
        acquire: DistributedAcquire,
        request: Request<ReqBody>,
        shared: Arc<Shared>,
        contended: bool,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    {
        let ready = self.take_ready();
        let pending = Pending::new(ready, request, WaitTicket::new(shared, contended));
        ResponseFuture::acquiring(acquire, pending)
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
        S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    {
        ResponseFuture::running(self.inner.call(request), None)
    }
}

impl<S: Clone, E: Clone> Clone for KeyedLock<S, E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            extractor: self.extractor.clone(),
            shared: self.shared.clone(),
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
