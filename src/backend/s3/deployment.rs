//! What an S3 deployment means for the locks, read for the deployment check: whether
//! the store enforces conditional writes (probed again, as at build), and S3's clock as
//! the `Date` of its answers tells it.

use super::{setup, Inner};
use crate::backend::deployment::clock_offset_seen;
use crate::backend::{Finding, SetupError};

/// The configuration findings of the bucket behind `inner`.
pub(super) async fn findings(inner: &Inner) -> Vec<Finding> {
    const CHECK: &str = "conditional_writes";
    const WHY: &str = "a lock is an object created with If-None-Match and replaced with \
        If-Match: a store that ignores either lets two instances hold one key";
    let config = &inner.config;
    let probed = setup::check(
        &inner.client,
        &inner.endpoint,
        &inner.bucket,
        &config.prefix,
        config.command_timeout,
    )
    .await;
    let conditional = match probed {
        Ok(()) => Finding::pass(
            CHECK,
            format!(
                "bucket {}: a second create and a write on another ETag were both refused",
                inner.bucket
            ),
            WHY,
        ),
        Err(SetupError::Unsafe(problem)) => Finding::fail(
            CHECK,
            problem,
            WHY,
            "use a store that enforces conditional writes (AWS S3 does since 2024; check an emulator's or gateway's version)",
        ),
        Err(error) => Finding::warn(
            CHECK,
            format!("not probed: {error}"),
            "the check could not tell",
            "allow s3:PutObject and s3:DeleteObject under the prefix, or check that S3 answers",
        ),
    };
    vec![conditional, clock_offset_seen(&inner.endpoint.clock)]
}
