//! What every service made by one [`ReplayLayer`](super::ReplayLayer) value shares: its
//! settings, its metric handles per lock layer, and its once-per-layer log of a
//! misconfiguration. The layer creates it; the service and `respond` read it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use http::request::Parts;
use http::{Extensions, StatusCode};

use super::metrics::ReplayMetrics;
use super::record::Fingerprint;
use super::store::{MemoryStore, ReplayStore};

pub(crate) type PrincipalFn = dyn Fn(&Extensions) -> Option<String> + Send + Sync;

/// Why a store that orders its writes by fencing token is refused under a backend that
/// issues none.
pub(crate) const NO_FENCING_TOKENS: &str = "the replay store needs fencing tokens (it \
    writes only with a token above the stored one) and the lock backend issues none, so \
    nothing would ever be stored: use PostgresBackendBuilder::fencing(true) (a RedlockBackend \
    never issues them: it cannot do so safely)";

/// A request's fingerprint from its head and buffered body: the built-in one, or one
/// over what [`fingerprint_with`](super::ReplayLayer::fingerprint_with) chose.
pub(crate) type FingerprintFn = dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync;

/// The configuration, fixed when the layer is applied.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn ReplayStore>,
    /// The same store, when it is a [`MemoryStore`]: read before the key is taken.
    pub(crate) memory: Option<MemoryStore>,
    pub(crate) ttl: Duration,
    pub(crate) max_request_bytes: usize,
    pub(crate) read_timeout: Duration,
    pub(crate) max_response_bytes: usize,
    pub(crate) fingerprint: bool,
    /// `None`: the built-in fingerprint over the whole body.
    pub(crate) fingerprint_fn: Option<Arc<FingerprintFn>>,
    pub(crate) mismatch_status: StatusCode,
    pub(crate) store_server_errors: bool,
    pub(crate) fail_open: bool,
    pub(crate) store_timeout: Duration,
    pub(crate) replayed_headers: Vec<HeaderName>,
    pub(crate) principal: Option<Arc<PrincipalFn>>,
}

impl Settings {
    /// Whether requests are told apart by the built-in fingerprint (over method, path,
    /// query and the whole body): then, within one scope, by their bodies alone.
    pub(crate) fn builtin_fingerprint(&self) -> bool {
        self.fingerprint && self.fingerprint_fn.is_none()
    }
}

/// State every clone of one layer shares.
#[derive(Default)]
pub(crate) struct Shared {
    /// Handles per lock layer name. One replay layer value may sit under several named
    /// lock layers (a `ReplayLayer` cloned into two `KeyedLockLayer::replay` calls): a
    /// single set registered under the first name seen would count every layer's
    /// replays under that name.
    metrics: RwLock<Vec<(Box<str>, Arc<ReplayMetrics>)>>,
    misconfiguration_logged: AtomicBool,
}

impl Shared {
    /// The handles for the lock layer `name` (it comes with each request's `LockInfo`),
    /// registered the first time that name is seen.
    pub(crate) fn metrics(&self, name: &str) -> Arc<ReplayMetrics> {
        let find = |all: &[(Box<str>, Arc<ReplayMetrics>)]| {
            all.iter()
                .find(|(seen, _)| **seen == *name)
                .map(|(_, metrics)| Arc::clone(metrics))
        };
        // A handle set is only ever added: a poisoned lock holds nothing half-written.
        if let Some(metrics) = find(&self.metrics.read().unwrap_or_else(PoisonError::into_inner)) {
            return metrics;
        }
        let mut all = self.metrics.write().unwrap_or_else(PoisonError::into_inner);
        find(&all).unwrap_or_else(|| {
            let metrics = Arc::new(ReplayMetrics::new(name));
            all.push((name.into(), Arc::clone(&metrics)));
            metrics
        })
    }

    /// Whether this is the first misconfiguration seen: log it once per layer.
    pub(crate) fn first_misconfiguration(&self) -> bool {
        !self.misconfiguration_logged.swap(true, Ordering::Relaxed)
    }
}
