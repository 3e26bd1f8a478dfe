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

/// Whether `error` is transient: worth another attempt inside the request's wait
/// (see [`aws::is_transient`](crate::backend::aws::is_transient)).
pub(super) fn is_transient<E: ProvideErrorMetadata>(error: &SdkError<E>) -> bool {
    crate::backend::aws::is_transient(error, TRANSIENT_CODES)
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
