//! What an etcd deployment means for the locks, read for the deployment check: the
//! member's version against the fix for stale leaders revoking live leases.

use tokio::time::timeout;

use super::setup::{revokes_from_a_stale_leader, STALE_LEADER_FIXED_IN};
use super::Inner;
use crate::backend::Finding;

/// The configuration findings of the member the client talks to.
pub(super) async fn findings(inner: &Inner) -> Vec<Finding> {
    let mut client = inner.client.clone();
    let status = timeout(inner.config.command_timeout, client.status()).await;
    let version = match status {
        Ok(Ok(status)) => status.version().to_owned(),
        Ok(Err(error)) => return vec![unread(&error.to_string())],
        Err(_) => return vec![unread("no answer within the command timeout")],
    };
    const WHY: &str = "before the fix, a leader that stalled and resumed can revoke leases \
        its successor kept alive: a holder's key is deleted and the next waiter granted at \
        once, and the holder is told only when its watch sees the deletion";
    let saw = format!("etcd {version}");
    match revokes_from_a_stale_leader(&version) {
        false => vec![Finding::pass("server_version", saw, WHY)],
        true => vec![Finding::warn(
            "server_version",
            saw,
            WHY,
            format!(
                "upgrade etcd (fixed in {STALE_LEADER_FIXED_IN}), or refuse such members with EtcdBackendBuilder::refuse_stale_leader_revocation(true)"
            ),
        )],
    }
}

fn unread(why: &str) -> Finding {
    Finding::warn(
        "server_version",
        format!("could not be read: {why}"),
        "the check could not tell",
        "check that etcd answers; the error says why not",
    )
}
