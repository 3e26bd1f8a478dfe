//! What [`build`](super::EtcdBackendBuilder::build) checks before it hands out a
//! backend (see [Unsafe setups refused](super#unsafe-setups-refused)): every endpoint
//! is asked for its status; those that do not answer are named with why, those that do
//! must be one cluster, and a server that lets a stale leader revoke live leases is
//! named in a warning (or refused, on request).

use std::error::Error;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::time::timeout;

use crate::backend::{ServerFailure, SetupError};

/// How errors name the engine.
pub(super) const ENGINE: &str = "etcd";

/// The etcd releases from which a leader that stalled and resumed no longer revokes
/// leases that its successor kept alive: 3.4.31, 3.5.13, 3.6.0.
pub(super) const STALE_LEADER_FIXED_IN: &str = "3.4.31, 3.5.13 and 3.6.0";

/// `error` and its sources, `: ` between them, each said once. The etcd client's
/// errors hide their sources (a gRPC status prints its source's `Debug`, a transport
/// error says only "transport error"), where the reason is (a refused connection, a
/// name that does not resolve), so they are walked here.
pub(super) fn chain(error: &(dyn Error + 'static)) -> String {
    const UNINFORMATIVE: &str = "transport error";
    let mut said: Vec<String> = Vec::new();
    let mut source = match error.downcast_ref::<etcd_client::Error>() {
        Some(etcd_client::Error::GRpcStatus(status)) => {
            said.push(match status.message() {
                "" => format!("{:?}", status.code()),
                message => format!("{:?}: {message}", status.code()),
            });
            status.source()
        }
        Some(etcd_client::Error::TransportError(inner)) => Some(inner as &(dyn Error + 'static)),
        _ => {
            said.push(error.to_string());
            error.source()
        }
    };
    while let Some(cause) = source {
        let text = cause.to_string();
        // Layers often repeat their source's words: say them once.
        if text != UNINFORMATIVE && !said.iter().any(|before| before.contains(&text)) {
            said.push(text);
        }
        source = cause.source();
    }
    if said.is_empty() {
        return UNINFORMATIVE.to_owned();
    }
    said.join(": ")
}

/// `endpoint` without a user name or password in its authority
/// (`http://user:secret@host:2379` → `http://host:2379`).
pub(super) fn without_credentials(endpoint: &str) -> String {
    let (scheme, rest) = match endpoint.find("://") {
        Some(at) => endpoint.split_at(at + 3),
        None => ("", endpoint),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}{}", &rest[at + 1..]),
        None => endpoint.to_owned(),
    }
}

/// What one endpoint said about itself.
struct Member {
    endpoint: String,
    cluster_id: u64,
    version: String,
}

/// Asks every endpoint for its status, each within `limit`, and checks what they say:
/// at least one answers, all that do are one cluster, and, when `refuse_stale_leader`
/// is set, none lets a stale leader revoke leases. Endpoints that did not answer are
/// logged.
pub(super) async fn check_endpoints(
    endpoints: &[String],
    options: &ConnectOptions,
    limit: Duration,
    refuse_stale_leader: bool,
) -> Result<(), SetupError> {
    let mut members = Vec::new();
    let mut unreachable = Vec::new();
    for endpoint in endpoints {
        let shown = without_credentials(endpoint);
        let probe = async {
            let mut client = Client::connect([endpoint], Some(options.clone())).await?;
            client.status().await
        };
        let failure = match timeout(limit, probe).await {
            Ok(Ok(status)) => {
                members.push(Member {
                    endpoint: shown,
                    cluster_id: status.header().map_or(0, |header| header.cluster_id()),
                    version: status.version().to_owned(),
                });
                continue;
            }
            Ok(Err(error)) => ServerFailure::new(shown, chain(&error)),
            Err(_) => ServerFailure::no_answer(shown, limit),
        };
        tracing::warn!(endpoint = %failure.server, error = %failure.cause, "etcd endpoint unreachable");
        unreachable.push(failure);
    }
    if members.is_empty() {
        return Err(SetupError::Failed {
            engine: ENGINE,
            failures: unreachable,
        });
    }
    if members
        .iter()
        .any(|m| m.cluster_id != members[0].cluster_id)
    {
        let ids: Vec<String> = members
            .iter()
            .map(|m| format!("{} is in cluster {:x}", m.endpoint, m.cluster_id))
            .collect();
        return Err(SetupError::Unsafe(format!(
            "the endpoints belong to different etcd clusters ({}); each would grant the \
             same key",
            ids.join(", ")
        )));
    }
    let unfixed: Vec<String> = members
        .iter()
        .filter(|member| revokes_from_a_stale_leader(&member.version))
        .map(|member| format!("{} at {}", member.version, member.endpoint))
        .collect();
    if unfixed.is_empty() {
        return Ok(());
    }
    let unfixed = unfixed.join(", ");
    if refuse_stale_leader {
        return Err(SetupError::Unsafe(format!(
            "etcd {unfixed} lets a leader that stalled revoke leases its successor kept \
             alive (fixed in etcd {STALE_LEADER_FIXED_IN}); refused by \
             refuse_stale_leader_revocation"
        )));
    }
    tracing::warn!(
        "etcd {unfixed} lets a stale leader revoke live leases (etcd issues 12528 and \
         15247): after a leader stalls and resumes, a holder's key can be deleted and the \
         next waiter granted at once; the holder is told when its watch sees the \
         deletion, which can come after that grant. Fixed in etcd {STALE_LEADER_FIXED_IN}"
    );
    Ok(())
}

/// Whether etcd `version` (`3.4.23`) lets a leader that stalled and resumed revoke,
/// before it learns it was replaced, leases that its successor kept alive. Fixed in
/// 3.4.31, 3.5.13 and 3.6.0; a version that cannot be read is given the benefit of
/// the doubt.
pub(super) fn revokes_from_a_stale_leader(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-', '+'])
        .map(|part| part.parse::<u32>().ok());
    let (Some(Some(major)), Some(Some(minor)), Some(Some(patch))) =
        (parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    match (major, minor) {
        (3, 4) => patch < 31,
        (3, 5) => patch < 13,
        (major, minor) => (major, minor) < (3, 4),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_before_the_stale_leader_fix_are_named() {
        for unfixed in [
            "3.3.27", "3.4.0", "3.4.23", "3.4.30", "3.5.0", "3.5.12", "2.3.8",
        ] {
            assert!(revokes_from_a_stale_leader(unfixed), "{unfixed}");
        }
        for fixed in [
            "3.4.31", "3.4.39", "3.5.13", "3.5.21", "3.6.0", "3.6.4", "4.0.0",
        ] {
            assert!(!revokes_from_a_stale_leader(fixed), "{fixed}");
        }
        for unreadable in ["", "3.4", "dev", "3.x.1"] {
            assert!(!revokes_from_a_stale_leader(unreadable), "{unreadable:?}");
        }
        assert!(revokes_from_a_stale_leader("v3.5.9"));
        assert!(revokes_from_a_stale_leader("3.5.12-rc.0"));
    }

    #[test]
    fn credentials_are_cut_from_endpoints() {
        assert_eq!(
            without_credentials("http://user:secret@etcd-0:2379"),
            "http://etcd-0:2379"
        );
        assert_eq!(
            without_credentials("https://a@b@etcd:2379/x"),
            "https://etcd:2379/x"
        );
        assert_eq!(
            without_credentials("user:pw@127.0.0.1:2379"),
            "127.0.0.1:2379"
        );
        assert_eq!(
            without_credentials("http://etcd-0:2379"),
            "http://etcd-0:2379"
        );
        // An `@` after the authority is not a credential.
        assert_eq!(
            without_credentials("http://etcd-0:2379/a@b"),
            "http://etcd-0:2379/a@b"
        );
    }

    #[test]
    fn every_unreachable_endpoint_is_named_with_its_cause() {
        let error = SetupError::Failed {
            engine: ENGINE,
            failures: vec![
                ServerFailure::no_answer("http://a:2379", Duration::from_millis(500)),
                ServerFailure::new(
                    "http://b:2379",
                    chain(&etcd_client::Error::InvalidArgs("bad".into())),
                ),
            ],
        };
        assert_eq!(
            error.to_string(),
            "etcd lock backend setup failed: at http://a:2379: no answer within 500ms; at \
             http://b:2379: invalid arguments: bad"
        );
        assert!(error.source().is_some());
    }
}
