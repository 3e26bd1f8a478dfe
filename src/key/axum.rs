//! The one file that knows axum: [`PathParam`] and the check for requests axum did not
//! route to any route.

use std::borrow::Cow;
use std::sync::Arc;

use http::request::Parts;

use super::{Key, KeyError, KeyExtractor};

/// The key is the named axum path parameter, e.g. `order_id` in
/// `/orders/{order_id}`.
///
/// A route without that parameter, or a request not routed by axum, gives
/// [`KeyError::Misconfigured`] (a server bug: 500); a parameter that is not UTF-8 once
/// percent-decoded gives [`KeyError::NotUtf8`].
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_keyed_lock::PathParam;
///
/// let extractor = PathParam::new("order_id");
/// // Used on routes such as:
/// let app: Router = Router::new().route("/orders/{order_id}/pay", post(|| async {}));
/// # let _ = (extractor, app);
/// ```
#[derive(Clone, Debug)]
pub struct PathParam {
    name: Arc<str>,
}

impl PathParam {
    /// Uses the path parameter called `name`.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        PathParam { name: name.into() }
    }
}

impl PathParam {
    /// Runs `with` on the parameter's value.
    fn with_value<R>(
        &self,
        parts: &mut Parts,
        with: impl FnOnce(&str) -> R,
    ) -> Result<R, KeyError> {
        use axum::extract::path::RawPathParams;
        use axum::extract::rejection::RawPathParamsRejection;
        use axum::extract::FromRequestParts;
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        // The extractor only reads the request extensions: its future is ready
        // on the first poll, so no runtime is needed. Pending is never expected.
        let future = std::pin::pin!(RawPathParams::from_request_parts(parts, &()));
        let params = match future.poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(params)) => params,
            Poll::Ready(Err(RawPathParamsRejection::InvalidUtf8InPathParam(_))) => {
                return Err(KeyError::NotUtf8)
            }
            // MissingPathParams (not routed by axum) and anything newer.
            Poll::Ready(Err(_)) | Poll::Pending => return Err(self.misconfigured()),
        };
        params
            .iter()
            .find(|(name, _)| *name == &*self.name)
            .map(|(_, value)| with(value))
            .ok_or_else(|| self.misconfigured())
    }

    fn misconfigured(&self) -> KeyError {
        KeyError::Misconfigured {
            source: Cow::Owned(format!("path parameter `{}`", self.name)),
        }
    }
}

/// Whether axum routed `parts` to a fallback: the router ran (it inserted path
/// parameters, possibly none) but no route matched (no `MatchedPath`). Such a request
/// passes the layer untouched, so `Router::layer` keeps the fallback's 404.
pub(crate) fn is_unrouted(parts: &mut Parts) -> bool {
    use axum::extract::{FromRequestParts, MatchedPath, RawPathParams};
    use std::future::Future;
    use std::task::{Context, Waker};

    if parts.extensions.get::<MatchedPath>().is_some() {
        return false;
    }
    // Ready on the first poll: it only reads the extensions.
    let params = std::pin::pin!(RawPathParams::from_request_parts(parts, &()));
    let routed = params.poll(&mut Context::from_waker(Waker::noop()));
    matches!(routed, std::task::Poll::Ready(Ok(_)))
}

impl KeyExtractor for PathParam {
    fn extract<'a>(&self, parts: &'a mut Parts) -> Result<Cow<'a, str>, KeyError> {
        self.with_value(parts, |value| Cow::Owned(value.to_owned()))
    }

    fn extract_key(&self, parts: &mut Parts, max_len: usize) -> Result<Key, KeyError> {
        // The parameters are owned by a temporary: validate in place, copy once.
        self.with_value(parts, |value| Key::new(value, max_len))?
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::Request;
    use axum::middleware::{self, Next};
    use axum::response::Response;
    use axum::routing::get;
    use axum::Router;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    /// Routes `uri` through `/orders/{order_id}` and returns what
    /// `PathParam::new(param)` extracted there, as `Ok(key)` or `Err(error)`.
    async fn extract_through_router(param: &'static str, uri: &str) -> String {
        let extract_into_body = move |req: Request, _next: Next| async move {
            let (mut parts, _body) = req.into_parts();
            let result = PathParam::new(param).extract(&mut parts);
            Response::new(Body::from(format!("{result:?}")))
        };
        let app = Router::new()
            .route("/orders/{order_id}", get(|| async { "handler" }))
            .route_layer(middleware::from_fn(extract_into_body));
        let request = Request::builder().uri(uri).body(Body::empty()).unwrap();
        let response = app.oneshot(request).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn present_param_is_percent_decoded() {
        assert_eq!(
            extract_through_router("order_id", "/orders/42").await,
            "Ok(\"42\")"
        );
        assert_eq!(
            extract_through_router("order_id", "/orders/caf%C3%A9").await,
            "Ok(\"café\")"
        );
    }

    #[tokio::test]
    async fn invalid_utf8_param_is_not_utf8() {
        assert_eq!(
            extract_through_router("order_id", "/orders/%FF").await,
            "Err(NotUtf8)"
        );
    }

    #[tokio::test]
    async fn unknown_param_name_is_a_misconfiguration() {
        assert_eq!(
            extract_through_router("user_id", "/orders/42").await,
            "Err(Misconfigured { source: \"path parameter `user_id`\" })"
        );
    }

    #[test]
    fn request_not_routed_by_axum_is_a_misconfiguration() {
        let (mut parts, ()) = http::Request::new(()).into_parts();
        let error = PathParam::new("order_id").extract(&mut parts).unwrap_err();
        assert!(matches!(error, KeyError::Misconfigured { .. }), "{error:?}");
        assert!(!is_unrouted(&mut parts), "not routed by axum at all");
    }
}
