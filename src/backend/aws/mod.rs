//! What the engines on the AWS SDK (DynamoDB, S3) share: where the client sends its
//! requests and the server's clock, both read from every request and answer by one
//! interceptor (`endpoint`); and which SDK errors are worth another attempt
//! (`transient`).

mod endpoint;
mod transient;

pub(crate) use self::endpoint::Endpoint;
pub(crate) use self::transient::is_transient;
