//! What every service made by one layer value shares: its settings, its lock table and
//! its metric handles. The layer creates it; the service, the response future, the
//! held key and the body read it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use http::StatusCode;

use super::info::LayerTag;
use super::names::NameClaim;
use super::rejected::{RejectionHandler, RejectionResponse};
use crate::backend::{LockMode, LostReason};
use crate::distributed::{DistributedLocks, DistributedLocksBuilder};
use crate::error::LockError;
use crate::key::KeyError;
use crate::locks::Mode;
use crate::metrics::Metrics;
use crate::reject::Rejection;

/// A layer's own settings, fixed before the layer is applied; the lock's (name,
/// permits, limits, backend) are in the layer's `DistributedLocksBuilder`.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) wait_timeout: Duration,
    pub(crate) timeout_status: StatusCode,
    pub(crate) retry_after: Duration,
    pub(crate) allow_missing_key: bool,
    pub(crate) hold_until_body_end: bool,
    pub(crate) long_hold: Option<Duration>,
    pub(crate) on_rejection: Option<RejectionHandler>,
    pub(crate) abort_on_lease_lost: bool,
    /// Whether spans carry a short escaped prefix of the key (`trace_keys`).
    pub(crate) trace_keys: bool,
    /// Request methods that take their key shared (`shared_methods`); empty: none.
    pub(crate) shared_methods: Box<[http::Method]>,
}

impl Config {
    /// How a request with `method` takes its key.
    pub(crate) fn mode_for(&self, method: &http::Method) -> Mode {
        match self.shared_methods.contains(method) {
            true => Mode::Shared,
            false => Mode::Exclusive,
        }
    }
}

/// The table, settings and metrics of one configured layer value.
pub(crate) struct Shared {
    /// The two-tier lock: this process's table, then the backend if there is one.
    pub(crate) locks: DistributedLocks,
    pub(crate) config: Config,
    /// The longest key accepted, as the locks check it.
    pub(crate) max_key_len: usize,
    /// Names this layer value in the `LockInfo` of its requests.
    pub(crate) tag: LayerTag,
    metrics: OnceLock<Metrics>,
    /// A misconfiguration is logged once per layer, not once per request.
    misconfiguration_logged: AtomicBool,
    /// The layer's name at its backend, held while the table lives.
    _name: Option<NameClaim>,
}

impl Shared {
    /// # Panics
    /// If `shared_methods` is set and the backend cannot hold a key shared (or
    /// `permits` is more than 1 and it cannot count them): a request must not be
    /// served exclusively or locally instead. If another live layer has this name on
    /// the same backend (see `names.rs`).
    pub(crate) fn new(locks: DistributedLocksBuilder, config: Config) -> Self {
        if !config.shared_methods.is_empty() {
            if let Some(refusal) = locks.refuses(LockMode::Shared) {
                panic!("KeyedLockLayer::shared_methods: {refusal}");
            }
        }
        let permits = locks.permit_count();
        if let Some(refusal) = locks.refuses(LockMode::permits(permits)) {
            panic!("KeyedLockLayer::permits({permits}): {refusal}");
        }
        let identity = locks
            .backend_handle()
            .and_then(|backend| backend.identity());
        let name = identity.map(|identity| {
            NameClaim::claim(
                identity,
                locks.name().clone(),
                describe_mode(permits, &config),
            )
        });
        Self {
            _name: name,
            tag: LayerTag::new(locks.name().clone()),
            max_key_len: locks.key_len_limit(),
            locks: locks.unmetered().build(),
            config,
            metrics: OnceLock::new(),
            misconfiguration_logged: AtomicBool::new(false),
        }
    }

    /// The layer's `name`, the label of its metrics and the namespace of its keys at a
    /// distributed backend.
    pub(crate) fn name(&self) -> &str {
        self.locks.name()
    }

    /// This layer's metric handles, registered on first use (the configuration, and so
    /// the `name` label, is final by then). Every request calls it before it locks, so
    /// the table is still empty when its key gauge is attached.
    pub(crate) fn metrics(&self) -> &Metrics {
        self.metrics.get_or_init(|| {
            let metrics = Metrics::new(self.name());
            self.locks.local().report_keys_to(metrics.keys.clone());
            metrics
        })
    }

    /// The rejection for a key that could not be taken from the request. A key source
    /// the server controls that is absent is the server's fault: logged once.
    pub(crate) fn key_rejection(&self, error: &KeyError) -> Rejection {
        if let KeyError::Misconfigured { source } = error {
            if !self.misconfiguration_logged.swap(true, Ordering::Relaxed) {
                tracing::error!(
                    layer = self.name(),
                    source = %source,
                    "KeyedLockLayer misconfigured: the request has no {source} to take \
                     the lock key from; answering 500 (logged once per layer)"
                );
            }
        }
        Rejection::for_key(error)
    }

    /// The rejection for a lock that could not be acquired.
    pub(crate) fn lock_rejection(&self, error: &LockError) -> Rejection {
        Rejection::for_lock(error, self.config.timeout_status, self.config.retry_after)
    }

    /// The rejection for a request aborted because its distributed lease was lost.
    pub(crate) fn lease_lost_rejection(&self, reason: LostReason) -> Rejection {
        Rejection::lease_lost(self.config.retry_after, reason)
    }

    /// The response for `rejection`: the user's handler's, or the default.
    pub(crate) fn respond(&self, rejection: Rejection) -> RejectionResponse {
        self.metrics().rejected(rejection.kind());
        tracing::debug!(
            layer = self.name(),
            reason = rejection.kind().as_str(),
            "request rejected"
        );
        match &self.config.on_rejection {
            Some(handler) => RejectionResponse::from_handler(handler, rejection),
            None => RejectionResponse::ready(rejection),
        }
    }
}

/// How a layer holds its keys, for the refusal of a second layer under its name.
fn describe_mode(permits: usize, config: &Config) -> String {
    let mut mode = match permits {
        1 => "exclusively".to_owned(),
        n => format!("with {n} permits"),
    };
    if !config.shared_methods.is_empty() {
        let methods: Vec<&str> = config.shared_methods.iter().map(|m| m.as_str()).collect();
        mode += &format!(" (shared for {})", methods.join(", "));
    }
    mode
}
