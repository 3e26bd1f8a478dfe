//! Pauses between attempts (jittered exponential backoff), and which DynamoDB errors
//! are worth another attempt.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};

/// Exponential backoff from `first` to `max`, each pause jittered.
#[derive(Debug)]
pub(super) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(super) fn new(first: Duration, max: Duration) -> Self {
        Self {
            next: first.min(max),
            max,
        }
    }

    /// The next pause: between half of the current step and all of it; the step
    /// doubles up to `max`.
    pub(super) fn pause(&mut self) -> Duration {
        let pause = jitter(self.next);
        self.next = (self.next * 2).min(self.max);
        pause
    }
}

/// A random duration between half of `max` and `max`, so that instances woken by the
/// same event do not retry in lockstep.
pub(super) fn jitter(max: Duration) -> Duration {
    let half = max / 2;
    let spread = u64::try_from((max - half).as_micros()).unwrap_or(u64::MAX);
    let random = getrandom::u64().unwrap_or(0);
    half + Duration::from_micros(random % spread.saturating_add(1))
}

/// Service errors that say "not now" rather than "never": throttling, capacity, and
/// the service's own failures. Another attempt may succeed.
const TRANSIENT_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "ThrottlingException",
    "InternalServerError",
    "ServiceUnavailable",
    "TransactionConflictException",
];

/// Whether `error` is transient: worth another attempt inside the request's wait.
/// Unreachable endpoints (connect errors, timeouts) are not: they fail the request at
/// once with [`LockError::Backend`](crate::LockError::Backend), as in the other
/// backends.
pub(super) fn is_transient<E: ProvideErrorMetadata>(error: &SdkError<E>) -> bool {
    match error {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or_default();
            TRANSIENT_CODES.contains(&code) || service.raw().status().is_server_error()
        }
        _ => false,
    }
}

/// A DynamoDB call that took longer than the command timeout.
#[derive(Debug)]
pub(super) struct CommandTimeout(pub(super) Duration);

impl fmt::Display for CommandTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dynamodb did not answer within {:?}", self.0)
    }
}

impl StdError for CommandTimeout {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_max_with_jitter() {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(60));
        let steps = [10, 20, 40, 60, 60];
        for step in steps.map(Duration::from_millis) {
            let pause = backoff.pause();
            assert!(pause >= step / 2 && pause <= step, "{pause:?} for {step:?}");
        }
    }

    #[test]
    fn jitter_stays_between_half_and_all() {
        for _ in 0..100 {
            let d = jitter(Duration::from_millis(100));
            assert!(d >= Duration::from_millis(50) && d <= Duration::from_millis(100));
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }
}
