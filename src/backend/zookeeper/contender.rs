//! One acquisition's contender at ZooKeeper, shared by the queueing steps
//! (`acquire`) and the lease that holds its node (`lease`).

use std::fmt;
use std::sync::{Arc, OnceLock};

use super::keys::LockPath;
use super::session::Session;

/// One acquisition at ZooKeeper: its session, its queue, its token, and its node once
/// the create was answered.
pub(super) struct Contender {
    pub(super) session: Arc<Session>,
    pub(super) path: LockPath,
    pub(super) token: String,
    pub(super) node: OnceLock<String>,
}

impl Contender {
    /// The path of the contender's node, if its create was answered.
    pub(super) fn node(&self) -> Option<&str> {
        self.node.get().map(String::as_str)
    }
}

impl fmt::Debug for Contender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Contender")
            .field("queue", &self.path.queue)
            .field("node", &self.node.get())
            .finish_non_exhaustive()
    }
}
