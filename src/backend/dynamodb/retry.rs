//! Which DynamoDB errors are worth another attempt, and the error of a call that timed
//! out.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};

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
