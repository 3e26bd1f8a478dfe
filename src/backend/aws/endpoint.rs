//! Where an AWS SDK client sends its requests, and the server's clock, read by an
//! interceptor the backend adds to its copy of the client.

use std::sync::{Arc, Mutex};

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::context::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::{ConfigBag, Storable, StoreReplace};
use aws_smithy_types::date_time::{DateTime, Format as DateTimeFormat};

use crate::backend::server_clock::ServerClock;

/// Where the client sends its requests, for errors: the scheme and host of the last
/// request it was about to send (the resolved endpoint: AWS's regional one, a local
/// server, a proxy), read by an interceptor since the SDK's config does not tell it;
/// before any request, `region <name>`.
///
/// The same interceptor reads the server's clock from the `Date` of every answer.
#[derive(Debug)]
pub(crate) struct Endpoint {
    seen: Mutex<Option<String>>,
    region: Option<String>,
    pub(crate) clock: ServerClock,
}

impl Endpoint {
    /// A recorder for a client of `region`; add [`interceptor`](Self::interceptor) to
    /// the client's config.
    pub(crate) fn new(region: Option<String>) -> Arc<Endpoint> {
        Arc::new(Endpoint {
            seen: Mutex::new(None),
            region,
            clock: ServerClock::default(),
        })
    }

    /// The interceptor that fills this recorder.
    pub(crate) fn interceptor(self: &Arc<Self>) -> impl Intercept + 'static {
        Recorder(self.clone())
    }

    /// `scheme://host[:port]` of the last request, or the region before any.
    pub(crate) fn describe(&self) -> String {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match (seen, &self.region) {
            (Some(endpoint), _) => endpoint,
            (None, Some(region)) => format!("region {region}"),
            (None, None) => "(no endpoint or region)".to_owned(),
        }
    }
}

/// The interceptor that fills an [`Endpoint`].
#[derive(Debug)]
struct Recorder(Arc<Endpoint>);

/// When a request's attempt went out, kept in its config bag until the answer.
#[derive(Clone, Copy, Debug)]
struct SentAt(tokio::time::Instant);

impl Storable for SentAt {
    type Storer = StoreReplace<Self>;
}

impl Intercept for Recorder {
    fn name(&self) -> &'static str {
        "tower_keyed_lock::EndpointRecorder"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        cfg.interceptor_state()
            .store_put(SentAt(tokio::time::Instant::now()));
        let uri = context.request().uri();
        // The scheme and authority only: never a path or a query.
        let end = uri
            .find("://")
            .map(|scheme| scheme + 3)
            .and_then(|start| uri[start..].find(['/', '?']).map(|end| start + end))
            .unwrap_or(uri.len());
        let authority = &uri[..end];
        // Credentials in the authority (`user:pass@host`) are left out.
        let authority = match (authority.find("://"), authority.rfind('@')) {
            (Some(scheme), Some(at)) => {
                format!("{}{}", &authority[..scheme + 3], &authority[at + 1..])
            }
            _ => authority.to_owned(),
        };
        let mut seen = self.0.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.as_deref() != Some(&*authority) {
            *seen = Some(authority);
        }
        Ok(())
    }

    fn read_before_deserialization(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let received = tokio::time::Instant::now();
        let date = context
            .response()
            .headers()
            .get("date")
            .and_then(|date| DateTime::from_str(date, DateTimeFormat::HttpDate).ok())
            .and_then(|date| u64::try_from(date.secs()).ok());
        if let (Some(secs), Some(SentAt(sent))) = (date, cfg.load::<SentAt>()) {
            self.0.clock.observe(secs, *sent, received);
        }
        Ok(())
    }
}
