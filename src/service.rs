//! [`KeyedLock`]: the service made by [`KeyedLockLayer`](crate::KeyedLockLayer).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tower_service::Service;

use crate::body::KeyedLockBody;
use crate::future::{Pending, ResponseFuture, WaitTicket};
use crate::held::HeldKey;
use crate::info::LockInfo;
use crate::key::KeyExtractor;
use crate::layer::Shared;
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
        let shared = self.shared.clone();
        let (mut parts, body) = request.into_parts();
        let key = self.extractor.extract_key(&mut parts, shared.max_key_len);
        let key = match key {
            Ok(key) => key,
            Err(error) if error.is_missing() && shared.allow_missing_key => {
                let request = Request::from_parts(parts, body);
                return ResponseFuture::running(self.inner.call(request), None);
            }
            Err(error) => {
                return ResponseFuture::rejected(shared.respond(shared.key_rejection(&error)))
            }
        };

        // Uncontended: take the key now and call the inner service at once, with no
        // clock read, timer or service clone.
        let error = match shared.locks.try_lock(key.clone()) {
            Ok(guard) if shared.backend.is_some() => {
                // Held here; now the backend.
                let ready = self.take_ready();
                let request = Request::from_parts(parts, body);
                let pending = Pending::new(ready, request, WaitTicket::new(shared, false));
                return ResponseFuture::remote(guard, pending);
            }
            Ok(guard) => {
                let metrics = shared.metrics();
                metrics.acquired_uncontended.increment(1);
                metrics.wait_acquired.record(0.0);
                let held = HeldKey::new(guard, None, shared);
                parts
                    .extensions
                    .insert(LockInfo::new(key, Duration::ZERO, None, None));
                let future = self.inner.call(Request::from_parts(parts, body));
                return ResponseFuture::running(future, Some(held));
            }
            Err(error) => error,
        };
        let busy = matches!(error, LockError::Busy);
        if !busy || shared.wait_timeout.is_zero() {
            if busy {
                shared.metrics().wait_timeout.record(0.0);
            }
            return ResponseFuture::rejected(shared.respond(shared.lock_rejection(&error)));
        }

        // Contended: wait for the key, then call the readied service.
        let ready = self.take_ready();
        let acquire = shared.locks.lock_timeout(key, shared.wait_timeout);
        let request = Request::from_parts(parts, body);
        let pending = Pending::new(ready, request, WaitTicket::new(shared, true));
        ResponseFuture::waiting(acquire, pending)
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
