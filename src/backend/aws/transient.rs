//! Which AWS SDK errors are worth another attempt within a request's wait.

use aws_smithy_runtime_api::client::result::SdkError;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;

/// Whether `error` is transient: worth another attempt inside the request's wait.
/// Besides the service's "not now" answers (`codes`, and every 5xx), a call that never
/// got an answer is: the endpoint unreachable or the connection broken (a dispatch
/// failure), the SDK's own timeout, an answer cut short. Only the wait bounds the
/// waiting (DESIGN rule 11): a wait whose every attempt failed ends at its deadline
/// with the last failure, as [`LockError::Backend`](crate::LockError::Backend). A
/// request the SDK could not build is not transient.
pub(crate) fn is_transient<E: ProvideErrorMetadata>(
    error: &SdkError<E, aws_smithy_runtime_api::http::Response>,
    codes: &[&str],
) -> bool {
    match error {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or_default();
            codes.contains(&code) || service.raw().status().is_server_error()
        }
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) | SdkError::ResponseError(_) => {
            true
        }
        _ => false,
    }
}
