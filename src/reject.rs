//! Rejections: why the layer answered instead of calling the inner service,
//! and the default `application/problem+json` (RFC 9457) response for each.
//!
//! This file decides, for every case, the status, the detail and whether a
//! `Retry-After` goes with it (the crate-private constructors of [`Rejection`]); the
//! lock layer, the body-reading layer and the replay layer only pick the case.
//!
//! ```
//! use std::time::Duration;
//! use http::StatusCode;
//! use tower_keyed_lock::{Rejection, RejectionKind};
//!
//! let rejection = Rejection::new(
//!     RejectionKind::Timeout,
//!     StatusCode::CONFLICT,
//!     Some(Duration::from_secs(2)),
//!     "a request for this key is already in progress",
//! );
//! let response = rejection.into_response();
//! assert_eq!(response.status(), StatusCode::CONFLICT);
//! assert_eq!(response.headers()["retry-after"], "2");
//! ```

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use crate::backend::{LostReason, RetryLater};
use crate::error::LockError;
use crate::key::KeyError;
pub use crate::rejection_kind::RejectionKind;

/// The `Content-Type` of every default rejection response.
const PROBLEM_JSON: &str = "application/problem+json";

/// A rejection, handed to a user error handler; [`Rejection::into_response`]
/// is the default answer.
#[derive(Debug, Clone)]
pub struct Rejection {
    kind: RejectionKind,
    status: StatusCode,
    retry_after: Option<Duration>,
    detail: Cow<'static, str>,
}

impl Rejection {
    /// A rejection of `kind`, answered with `status`, an optional
    /// `Retry-After`, and `detail` as the human-readable explanation. The
    /// detail is sent to the client: it must not contain a raw key.
    pub fn new(
        kind: RejectionKind,
        status: StatusCode,
        retry_after: Option<Duration>,
        detail: impl Into<Cow<'static, str>>,
    ) -> Self {
        Rejection {
            kind,
            status,
            retry_after,
            detail: detail.into(),
        }
    }

    /// Why the request was rejected.
    pub fn kind(&self) -> RejectionKind {
        self.kind
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// When the client may retry, if that is known.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The human-readable explanation.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The default response: `status`, `Content-Type: application/problem+json`,
    /// `Retry-After` in whole seconds (rounded up, at least 1) when
    /// [`retry_after`](Self::retry_after) is set, and an RFC 9457 body:
    ///
    /// ```json
    /// {"type":"about:blank","title":"Conflict","status":409,"detail":"...","reason":"timeout"}
    /// ```
    ///
    /// `title` is the status's canonical reason phrase (`"Error"` for a status
    /// that has none).
    pub fn into_response(self) -> Response<Bytes> {
        let title = self.status.canonical_reason().unwrap_or("Error");
        let mut body = String::with_capacity(128 + self.detail.len());
        body.push_str(r#"{"type":"about:blank","title":"#);
        crate::json_text::push_string(&mut body, title);
        let _ = write!(body, r#","status":{},"detail":"#, self.status.as_u16());
        crate::json_text::push_string(&mut body, &self.detail);
        body.push_str(r#","reason":"#);
        crate::json_text::push_string(&mut body, self.kind.as_str());
        body.push('}');

        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(retry_after) = self.retry_after {
            headers.insert(
                RETRY_AFTER,
                HeaderValue::from(retry_after_secs(retry_after)),
            );
        }
        response
    }
}

/// A rejection is an axum response too: the same `problem+json` body.
#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Rejection {
    fn into_response(self) -> axum::response::Response {
        Rejection::into_response(self).map(axum::body::Body::from)
    }
}

/// The case → status, detail and `Retry-After` policy, one constructor per case.
impl Rejection {
    /// No usable key in the request: 400, or 500 when the key source is one the server
    /// controls (a misconfiguration).
    pub(crate) fn for_key(error: &KeyError) -> Self {
        match error {
            KeyError::Misconfigured { .. } => Self::misconfigured(
                "the server is not configured to take a lock key from this request",
            ),
            _ => Self::new(
                RejectionKind::from(error),
                StatusCode::BAD_REQUEST,
                None,
                format!("no usable lock key: {error}"),
            ),
        }
    }

    /// The lock could not be acquired: the layer's `timeout_status` for a busy key,
    /// 429 for a full queue, 503 for a full table or a failed backend; each with
    /// `Retry-After`. A backend that says why and for how long (a [`RetryLater`], such
    /// as the Redis restart guard) gets its own detail and `Retry-After`.
    pub(crate) fn for_lock(
        error: &LockError,
        timeout_status: StatusCode,
        retry_after: Duration,
    ) -> Self {
        if let LockError::Backend(cause) = error {
            if let Some(later) = cause.downcast_ref::<RetryLater>() {
                return Self::new(
                    RejectionKind::Backend,
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some(later.retry_after()),
                    later.detail().to_owned(),
                );
            }
        }
        let kind = RejectionKind::of(error);
        let (status, detail) = match kind {
            RejectionKind::Timeout => (
                timeout_status,
                "a request for this key is already in progress",
            ),
            RejectionKind::QueueFull => (
                StatusCode::TOO_MANY_REQUESTS,
                "too many requests are waiting for this key",
            ),
            RejectionKind::TooManyKeys => {
                (StatusCode::SERVICE_UNAVAILABLE, "too many keys are in use")
            }
            // The layer refuses such a setup when it is built; kept for completeness.
            RejectionKind::Misconfigured => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the lock backend cannot take this lock",
            ),
            RejectionKind::ShuttingDown => (
                StatusCode::SERVICE_UNAVAILABLE,
                "this instance is shutting down; retry, another instance will take the request",
            ),
            // The layer validates keys before it locks; kept for completeness.
            RejectionKind::InvalidKey => (StatusCode::BAD_REQUEST, "the lock key cannot be used"),
            // `Backend`, the only other kind a lock error has.
            _ => (
                StatusCode::SERVICE_UNAVAILABLE,
                "the lock backend is unavailable",
            ),
        };
        Self::new(kind, status, Some(retry_after), detail)
    }

    /// The distributed lease was lost while the request ran (and the layer aborts then).
    pub(crate) fn lease_lost(retry_after: Duration, reason: LostReason) -> Self {
        let detail = match reason {
            LostReason::Unreachable => {
                "the lock lease was lost while the request ran: the lock engine could not be reached"
            }
            LostReason::Expired => {
                "the lock lease was lost while the request ran: it expired before it was renewed"
            }
            LostReason::NotOwner => {
                "the lock lease was lost while the request ran: the lock engine gave the key to another holder"
            }
            LostReason::ShutDown => {
                "the lock lease was given back while the request ran: this instance is shutting down"
            }
        };
        Self::new(
            RejectionKind::LeaseLost,
            StatusCode::SERVICE_UNAVAILABLE,
            Some(retry_after),
            detail,
        )
    }

    /// The request body is longer than `limit` bytes.
    pub(crate) fn body_too_large(limit: usize) -> Self {
        Self::new(
            RejectionKind::BodyTooLarge,
            StatusCode::PAYLOAD_TOO_LARGE,
            None,
            format!("the request body is longer than {limit} bytes"),
        )
    }

    /// The request body did not arrive within the read timeout.
    pub(crate) fn body_late() -> Self {
        Self::new(
            RejectionKind::BodyUnread,
            StatusCode::REQUEST_TIMEOUT,
            None,
            "the request body did not arrive in time",
        )
    }

    /// The request body broke off or was malformed.
    pub(crate) fn body_broken() -> Self {
        Self::new(
            RejectionKind::BodyUnread,
            StatusCode::BAD_REQUEST,
            None,
            "the request body could not be read",
        )
    }

    /// The layers are set up in a way that cannot work: 500, explained by `detail`.
    pub(crate) fn misconfigured(detail: impl Into<Cow<'static, str>>) -> Self {
        Self::new(
            RejectionKind::Misconfigured,
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            detail,
        )
    }
}

/// Whole seconds, rounded up so a client never retries too early, and at least
/// 1 because `Retry-After: 0` invites an immediate retry storm.
fn retry_after_secs(duration: Duration) -> u64 {
    let rounded_up = duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_nanos() > 0));
    rounded_up.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn body_text(response: &Response<Bytes>) -> &str {
        std::str::from_utf8(response.body()).unwrap()
    }

    #[test]
    fn every_kind_has_its_reason_label() {
        let cases = [
            (RejectionKind::Timeout, StatusCode::CONFLICT, "timeout"),
            (
                RejectionKind::QueueFull,
                StatusCode::TOO_MANY_REQUESTS,
                "queue_full",
            ),
            (
                RejectionKind::TooManyKeys,
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_keys",
            ),
            (
                RejectionKind::MissingKey,
                StatusCode::BAD_REQUEST,
                "missing_key",
            ),
            (
                RejectionKind::InvalidKey,
                StatusCode::BAD_REQUEST,
                "invalid_key",
            ),
            (
                RejectionKind::Backend,
                StatusCode::SERVICE_UNAVAILABLE,
                "backend",
            ),
            (
                RejectionKind::LeaseLost,
                StatusCode::SERVICE_UNAVAILABLE,
                "lease_lost",
            ),
            (
                RejectionKind::FingerprintMismatch,
                StatusCode::UNPROCESSABLE_ENTITY,
                "fingerprint_mismatch",
            ),
            (
                RejectionKind::BodyTooLarge,
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
            ),
            (
                RejectionKind::BodyUnread,
                StatusCode::REQUEST_TIMEOUT,
                "body_unread",
            ),
            (
                RejectionKind::Misconfigured,
                StatusCode::INTERNAL_SERVER_ERROR,
                "misconfigured",
            ),
            (
                RejectionKind::ShuttingDown,
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
            ),
        ];
        assert_eq!(cases.len(), RejectionKind::ALL.len());
        for (kind, status, reason) in cases {
            assert_eq!(kind.as_str(), reason);
            let response = Rejection::new(kind, status, None, "why").into_response();
            assert_eq!(response.status(), status);
            assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
            assert!(response.headers().get(RETRY_AFTER).is_none());
            let expected = format!(
                r#"{{"type":"about:blank","title":"{}","status":{},"detail":"why","reason":"{}"}}"#,
                status.canonical_reason().unwrap(),
                status.as_u16(),
                reason,
            );
            assert_eq!(body_text(&response), expected);
        }
    }

    #[test]
    fn accessors_return_what_was_given() {
        let rejection = Rejection::new(
            RejectionKind::QueueFull,
            StatusCode::TOO_MANY_REQUESTS,
            Some(Duration::from_millis(1500)),
            String::from("too many waiters"),
        );
        assert_eq!(rejection.kind(), RejectionKind::QueueFull);
        assert_eq!(rejection.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(rejection.retry_after(), Some(Duration::from_millis(1500)));
        assert_eq!(rejection.detail(), "too many waiters");
    }

    #[test]
    fn shutting_down_is_503_with_retry_after() {
        let rejection = Rejection::for_lock(
            &LockError::ShuttingDown,
            StatusCode::CONFLICT,
            Duration::from_secs(2),
        );
        assert_eq!(rejection.kind(), RejectionKind::ShuttingDown);
        let response = rejection.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "2");
        assert!(body_text(&response).contains(r#""reason":"shutting_down""#));
    }

    #[test]
    fn json_body_key_errors_are_invalid_keys() {
        for error in [KeyError::NotJson, KeyError::NotText] {
            assert_eq!(RejectionKind::from(&error), RejectionKind::InvalidKey);
            assert_eq!(Rejection::for_key(&error).status(), StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn key_errors_map_to_missing_or_invalid() {
        assert_eq!(
            RejectionKind::from(&KeyError::Missing),
            RejectionKind::MissingKey
        );
        assert_eq!(
            RejectionKind::from(&KeyError::Empty),
            RejectionKind::InvalidKey
        );
        assert_eq!(
            RejectionKind::from(&KeyError::TooLong { len: 9, limit: 8 }),
            RejectionKind::InvalidKey
        );
    }

    #[test]
    fn detail_is_escaped_into_valid_json() {
        let detail = "say \"hi\" \\ then\nnext\u{1b}[0m é";
        let response = Rejection::new(
            RejectionKind::InvalidKey,
            StatusCode::BAD_REQUEST,
            None,
            detail,
        )
        .into_response();
        assert_eq!(
            body_text(&response),
            r#"{"type":"about:blank","title":"Bad Request","status":400,"detail":"say \"hi\" \\ then\u000anext\u001b[0m é","reason":"invalid_key"}"#
        );
    }

    #[test]
    fn retry_after_is_rounded_up_to_whole_seconds() {
        let header_for = |retry_after: Duration| {
            let response = Rejection::new(
                RejectionKind::Timeout,
                StatusCode::CONFLICT,
                Some(retry_after),
                "busy",
            )
            .into_response();
            response.headers()[RETRY_AFTER].to_str().unwrap().to_owned()
        };
        assert_eq!(header_for(Duration::from_millis(1200)), "2");
        assert_eq!(header_for(Duration::from_secs(2)), "2");
        assert_eq!(header_for(Duration::ZERO), "1");
        assert_eq!(header_for(Duration::from_nanos(1)), "1");
        assert_eq!(header_for(Duration::MAX), u64::MAX.to_string());
    }

    #[test]
    fn status_without_reason_phrase_gets_generic_title() {
        let status = StatusCode::from_u16(599).unwrap();
        let response = Rejection::new(RejectionKind::Backend, status, None, "down").into_response();
        assert!(body_text(&response).contains(r#""title":"Error","status":599"#));
    }

    /// Decodes the body of a JSON string literal as written by
    /// `push_json_string`, failing on anything JSON does not allow.
    fn decode_json_string(literal: &str) -> Option<String> {
        let inner = literal.strip_prefix('"')?.strip_suffix('"')?;
        let mut out = String::new();
        let mut chars = inner.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next()? {
                    '"' => out.push('"'),
                    '\\' => out.push('\\'),
                    'u' => {
                        let hex: String = chars.by_ref().take(4).collect();
                        let code = u32::from_str_radix(&hex, 16).ok()?;
                        out.push(char::from_u32(code)?);
                    }
                    _ => return None,
                },
                // JSON forbids raw quotes and C0 controls inside a string.
                '"' | '\0'..='\u{1f}' => return None,
                c => out.push(c),
            }
        }
        Some(out)
    }

    proptest! {
        #[test]
        fn json_string_round_trips(s in any::<String>()) {
            let mut literal = String::new();
            crate::json_text::push_string(&mut literal, &s);
            prop_assert!(!literal.chars().any(char::is_control));
            prop_assert_eq!(decode_json_string(&literal), Some(s));
        }
    }
}
