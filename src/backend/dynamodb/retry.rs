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
/// Besides the service's "not now" answers, a call that never got an answer is: the
/// endpoint unreachable or the connection broken (a dispatch failure), the SDK's own
/// timeout, an answer cut short. Only the wait bounds the waiting (DESIGN rule 11): a
/// wait whose every attempt failed ends at its deadline with the last failure, as
/// [`LockError::Backend`](crate::LockError::Backend). A request the SDK could not
/// build is not transient.
pub(super) fn is_transient<E: ProvideErrorMetadata>(error: &SdkError<E>) -> bool {
    match error {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or_default();
            TRANSIENT_CODES.contains(&code) || service.raw().status().is_server_error()
        }
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_) => {
            true
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
