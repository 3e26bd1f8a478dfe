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

/// Checks the bucket with `HeadBucket` (a 403 passes: a policy may grant the lock its
/// objects and nothing on the bucket), then probes conditional writes under the
/// prefix: an object created with `If-None-Match: *` must refuse a second such create
/// (412, or 409 for a conflicting write), and a write with `If-Match` on another ETag;
/// the probe object is deleted after, whatever the probe found. Each call within
/// `limit`.
pub(super) async fn check(
    client: &Client,
    endpoint: &Endpoint,
    bucket: &str,
    prefix: &str,
    limit: Duration,
) -> Result<(), SetupError> {
    let failed = |what: &str, error: &(dyn std::error::Error + 'static)| {
        let cause = format!("{what}: {}", with_cause(error));
        SetupError::failed(ENGINE, endpoint.describe(), cause)
    };
    let no_answer = |_| SetupError::no_answer(ENGINE, endpoint.describe(), limit);
    let headed = timeout(limit, client.head_bucket().bucket(bucket).send())
        .await
        .map_err(no_answer)?;
    if let Err(error) = headed {
        if status(&error) != Some(403) {
            return Err(failed(
                &format!("the lock bucket {bucket:?} is not usable"),
                &error,
            ));
        }
    }

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
    timeout(limit, put("first").if_none_match("*").send())
        .await
        .map_err(no_answer)?
        .map_err(|error| failed("writing a probe object under the prefix", &error))?;
    let refused = |header: &str, why: &str| {
        SetupError::Unsafe(format!(
            "S3 at {} ignores `{header}`: {why}, so two instances could hold one key; use a \
             store that enforces conditional writes",
            endpoint.describe()
        ))
    };
    let probes = [
        (
            "If-None-Match",
            put("second").if_none_match("*"),
            "a second create of one object succeeded",
        ),
        (
            "If-Match",
            put("third").if_match("\"0\""),
            "a write conditional on another ETag succeeded",
        ),
    ];
    let mut found = Ok(());
    for (header, write, why) in probes {
        found = match timeout(limit, write.send()).await {
            Err(elapsed) => Err(no_answer(elapsed)),
            Ok(Ok(_)) => Err(refused(header, why)),
            Ok(Err(error)) if matches!(status(&error), Some(412 | 409)) => Ok(()),
            Ok(Err(error)) => Err(failed(&format!("probing `{header}`"), &error)),
        };
        if found.is_err() {
            break;
        }
    }
    // The probe object is ours: deleted unconditionally.
    let deleted = timeout(
        limit,
        client.delete_object().bucket(bucket).key(&probe).send(),
    )
    .await
    .map_err(no_answer)
    .and_then(|deleted| deleted.map_err(|error| failed("deleting the probe object", &error)));
    found.and(deleted.map(|_| ()))
}
