//! What [`build`](super::S3BackendBuilder::build) checks at S3: that the bucket answers,
//! and that it enforces conditional writes (an emulator or gateway that ignores
//! `If-None-Match` or `If-Match` would let two holders in at once).

use std::time::Duration;

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::Client;
use tokio::time::timeout;

use super::names::probe_name;
use super::object::status;
use super::ENGINE;
use crate::backend::aws::Endpoint;
use crate::backend::located::with_cause;
use crate::backend::SetupError;

/// Checks the bucket with `HeadBucket`, then probes conditional writes under the
/// prefix: an object created with `If-None-Match: *` must refuse a second such create
/// (412 or 409), and a write with `If-Match` on another ETag; the probe object is
/// deleted after. Each call within `limit`.
pub(super) async fn check(
    client: &Client,
    endpoint: &Endpoint,
    bucket: &str,
    prefix: &str,
    limit: Duration,
) -> Result<(), SetupError> {
    let failed = |what: &str, error: &(dyn std::error::Error + 'static)| {
        SetupError::failed(
            ENGINE,
            endpoint.describe(),
            format!("{what}: {}", with_cause(error)),
        )
    };
    let no_answer = |_| SetupError::no_answer(ENGINE, endpoint.describe(), limit);
    timeout(limit, client.head_bucket().bucket(bucket).send())
        .await
        .map_err(no_answer)?
        .map_err(|error| failed(&format!("the lock bucket {bucket:?} is not usable"), &error))?;

    let token = crate::backend::ttl::fresh_token()
        .map_err(|error| SetupError::failed(ENGINE, endpoint.describe(), error.to_string()))?;
    let probe = probe_name(prefix, &token);
    let put = |body: &'static str| {
        client
            .put_object()
            .bucket(bucket)
            .key(&probe)
            .body(ByteStream::from_static(body.as_bytes()))
    };
    let created = timeout(limit, put("first").if_none_match("*").send())
        .await
        .map_err(no_answer)?
        .map_err(|error| failed("writing a probe object under the prefix", &error))?;
    let mut unsafe_setup = None;
    match timeout(limit, put("second").if_none_match("*").send()).await {
        Err(elapsed) => unsafe_setup = Some(Err(no_answer(elapsed))),
        Ok(Ok(_)) => {
            unsafe_setup = Some(Err(SetupError::Unsafe(format!(
                "S3 at {} ignores `If-None-Match: *`: a second create of one object succeeded, so \
             two instances could hold one key; use a store that enforces conditional writes",
                endpoint.describe()
            ))))
        }
        Ok(Err(error)) if matches!(status(&error), Some(412 | 409)) => {}
        Ok(Err(error)) => unsafe_setup = Some(Err(failed("probing `If-None-Match`", &error))),
    }
    if unsafe_setup.is_none() {
        match timeout(limit, put("third").if_match("\"0\"").send()).await {
            Err(elapsed) => unsafe_setup = Some(Err(no_answer(elapsed))),
            Ok(Ok(_)) => {
                unsafe_setup = Some(Err(SetupError::Unsafe(format!(
                "S3 at {} ignores `If-Match`: a write conditional on another ETag succeeded, so \
                 a holder's renewal could overwrite a takeover; use a store that enforces \
                 conditional writes",
                endpoint.describe()
            ))))
            }
            Ok(Err(error)) if matches!(status(&error), Some(412 | 409)) => {}
            Ok(Err(error)) => unsafe_setup = Some(Err(failed("probing `If-Match`", &error))),
        }
    }
    // The probe object goes whatever the probe found (unconditionally: it is ours).
    let _ = created;
    let deleted = timeout(
        limit,
        client.delete_object().bucket(bucket).key(&probe).send(),
    )
    .await;
    if let Some(refused) = unsafe_setup {
        return refused;
    }
    deleted
        .map_err(no_answer)?
        .map_err(|error| failed("deleting the probe object", &error))?;
    Ok(())
}
