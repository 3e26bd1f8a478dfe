//! A key held by a request, with the accounting that goes with holding it.

use std::sync::Arc;
use std::time::Instant;

use tracing::Span;

use super::shared::Shared;
use crate::backend::{LeaseSignal, LostReason};
use crate::distributed::DistributedGuard;
use crate::key::Key;
use crate::locks::HashHold;

/// What a [`HeldKey`] holds.
enum Guard {
    /// Taken at once in a layer without a backend: held in the layer's own table, which
    /// `HeldKey::shared` keeps alive, so it needs no guard of its own (no reference
    /// count to move per request). The key itself, for the long-hold warning, is in
    /// `HeldKey::extra`, kept only when the layer warns.
    Local(Option<HashHold>),
    /// Everything else: a wait, or a backend. Boxed, to keep the commonest request's
    /// future small.
    Distributed(Box<DistributedGuard>),
}

/// Owns a request's hold on its key; on drop releases it and records the hold time.
/// Warns once if the hold outlives the layer's long-hold threshold.
pub(crate) struct HeldKey {
    guard: Guard,
    since: Instant,
    shared: Arc<Shared>,
    warned: bool,
    /// What only some layers need: `None` for a layer with neither a `tracing`
    /// subscriber that wants its spans nor a long-hold threshold, so the future every
    /// request moves around stays small.
    extra: Option<Box<Extra>>,
}

/// The rarely needed parts of a [`HeldKey`].
struct Extra {
    /// `keyed_lock.hold`: entered while the inner service is called and polled.
    span: Span,
    /// The key of a local hold, for the long-hold warning; kept only when the layer
    /// warns.
    key: Option<Key>,
}

impl HeldKey {
    /// `span`: the hold span, if a subscriber may want it.
    pub(crate) fn local(
        hold: HashHold,
        key: &Key,
        shared: Arc<Shared>,
        span: Option<Span>,
    ) -> Self {
        let key = shared.config.long_hold.map(|_| key.clone());
        Self::new(Guard::Local(Some(hold)), shared, span, key)
    }

    pub(crate) fn distributed(
        guard: DistributedGuard,
        shared: Arc<Shared>,
        span: Option<Span>,
    ) -> Self {
        Self::new(Guard::Distributed(Box::new(guard)), shared, span, None)
    }

    fn new(guard: Guard, shared: Arc<Shared>, span: Option<Span>, key: Option<Key>) -> Self {
        let span = span.filter(|span| !span.is_none());
        let extra = match (span, key) {
            (None, None) => None,
            (span, key) => Some(Box::new(Extra {
                span: span.unwrap_or_else(Span::none),
                key,
            })),
        };
        Self {
            guard,
            since: Instant::now(),
            shared,
            warned: false,
            extra,
        }
    }

    /// The hold span; `Span::none()` when no subscriber wanted it.
    fn span(&self) -> &Span {
        static NONE: Span = Span::none();
        self.extra.as_ref().map_or(&NONE, |extra| &extra.span)
    }

    /// Enters the hold span (until the returned guard drops); nothing when no
    /// subscriber wanted it.
    #[inline]
    pub(crate) fn enter(&self) -> Option<tracing::span::Entered<'_>> {
        let span = &self.extra.as_ref()?.span;
        (!span.is_none()).then(|| span.enter())
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Why the key's lease was lost, once it is; `None` in process.
    pub(crate) fn lost_reason(&self) -> Option<LostReason> {
        match &self.guard {
            Guard::Local(_) => None,
            Guard::Distributed(guard) => guard.lost_reason(),
        }
    }

    /// Whether the key stays held until the response body ends.
    pub(crate) fn until_body_end(&self) -> bool {
        self.shared.config.hold_until_body_end
    }

    /// Logs one warning per hold once it has lasted longer than the threshold. Checked
    /// whenever the request makes progress and at release: no timer per request.
    #[inline]
    pub(crate) fn check_long_hold(&mut self) {
        if let Some(threshold) = self.shared.config.long_hold {
            self.warn_if_held_over(threshold);
        }
    }

    #[cold]
    fn warn_if_held_over(&mut self, threshold: std::time::Duration) {
        let held = self.since.elapsed();
        if !self.warned && held > threshold {
            self.warned = true;
            let key = match &self.guard {
                Guard::Local(_) => self.extra.as_ref().and_then(|extra| extra.key.as_ref()),
                Guard::Distributed(guard) => Some(guard.key_ref()),
            };
            tracing::warn!(
                layer = self.shared.name(),
                held_ms = held.as_millis() as u64,
                key = %key.map(Key::short).unwrap_or_default(),
                "key held longer than the long-hold threshold"
            );
        }
    }
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        self.check_long_hold();
        let metrics = self.shared.metrics();
        metrics.hold.record(self.since.elapsed());
        match &mut self.guard {
            Guard::Local(hold) => {
                if let Some(hold) = hold.take() {
                    self.shared.locks.local().release(hold);
                }
            }
            Guard::Distributed(guard) => {
                let failures = guard.lease().map_or(0, LeaseSignal::renewal_failures);
                metrics.lease_ended(guard.lost_reason(), failures);
                if let Some(reason) = guard.lost_reason() {
                    tracing::warn!(
                        parent: self.span(),
                        layer = self.shared.name(),
                        reason = reason.as_str(),
                        "the lease was lost while the request held the key"
                    );
                }
                // Dropped with the fields; a remote release runs as its own task.
            }
        }
    }
}
