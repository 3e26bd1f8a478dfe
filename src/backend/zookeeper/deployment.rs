//! What a ZooKeeper deployment means for the locks, for the deployment check: the
//! session timeout the ensemble granted against the one asked, since the session is
//! the lease.

use std::time::Duration;

use crate::backend::Finding;

/// The session timeout finding: granted as asked, or moved by the ensemble's bounds.
pub(super) fn session_timeout(asked: Duration, granted: Duration) -> Finding {
    let saw = format!("session timeout {granted:?} granted for the {asked:?} asked");
    if granted == asked {
        return Finding::pass(
            "session_timeout",
            saw,
            "the session is the lease: a stopped holder's key is freed one session timeout after the ensemble last heard of it",
        );
    }
    Finding::warn(
        "session_timeout",
        saw,
        "the session is the lease, and the ensemble bounds it (by default between 2 and 20 \
         ticks): a longer one keeps a crashed holder's key that much longer, a shorter one \
         loses the lock of a holder that pauses that long",
        "ask for a lease within the ensemble's bounds, or set its minSessionTimeout / maxSessionTimeout (or tickTime) so that it grants what is asked",
    )
}
