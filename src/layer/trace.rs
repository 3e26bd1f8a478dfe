//! The layer's `tracing` spans: `keyed_lock.wait` while a request waits for its key,
//! `keyed_lock.hold` while it runs under it (the handler's own spans nest inside).
//!
//! Both are DEBUG spans carrying the layer's `name` and the `route` template (axum's
//! `MatchedPath`), never the raw key — it comes from the client — unless the layer
//! opts in with [`trace_keys`](crate::KeyedLockLayer::trace_keys), and then only a
//! short escaped prefix. Without a subscriber that wants them, a span is `Span::none()`
//! after one load of the global level, and entering it is a branch.

use tracing::field::Empty;
use tracing::Span;

use super::shared::Shared;
use crate::key::Key;

/// The route template of a request, if axum routed it.
fn route(extensions: &http::Extensions) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(path) = extensions.get::<axum::extract::MatchedPath>() {
        return Some(path.as_str());
    }
    let _ = extensions;
    None
}

/// The span of a request waiting for `key`; its `outcome` is recorded when the wait
/// ends.
#[inline]
pub(crate) fn wait_span(shared: &Shared, extensions: &http::Extensions, key: &Key) -> Span {
    match enabled() {
        true => new_wait_span(shared, extensions, key),
        false => Span::none(),
    }
}

#[cold]
#[inline(never)]
fn new_wait_span(shared: &Shared, extensions: &http::Extensions, key: &Key) -> Span {
    let span = tracing::debug_span!(
        "keyed_lock.wait",
        name = shared.name(),
        route = route(extensions),
        key = Empty,
        outcome = Empty,
    );
    record_key(&span, shared, key);
    span
}

/// The span of a request holding `key`; `None` when no subscriber may want it.
#[inline]
pub(crate) fn hold_span(
    shared: &Shared,
    extensions: &http::Extensions,
    key: &Key,
    shared_mode: bool,
    fencing_token: Option<u64>,
) -> Option<Span> {
    enabled().then(|| new_hold_span(shared, extensions, key, shared_mode, fencing_token))
}

#[cold]
#[inline(never)]
fn new_hold_span(
    shared: &Shared,
    extensions: &http::Extensions,
    key: &Key,
    shared_mode: bool,
    fencing_token: Option<u64>,
) -> Span {
    let span = tracing::debug_span!(
        "keyed_lock.hold",
        name = shared.name(),
        route = route(extensions),
        key = Empty,
        shared = shared_mode,
        fencing_token,
    );
    record_key(&span, shared, key);
    span
}

/// Whether any subscriber may want a DEBUG span: one load of tracing's global level.
/// Without it, a disabled span still carries its metadata, and with `tracing`'s `log`
/// feature (which other crates turn on) entering and leaving it checks `log`'s level
/// each time; `Span::none()` carries nothing.
#[inline]
fn enabled() -> bool {
    tracing::Level::DEBUG <= tracing::level_filters::LevelFilter::current()
}

fn record_key(span: &Span, shared: &Shared, key: &Key) {
    if shared.config.trace_keys && !span.is_disabled() {
        span.record("key", key.short());
    }
}
