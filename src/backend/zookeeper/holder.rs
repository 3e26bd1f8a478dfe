//! Who holds a key (see [Who holds a key](super#who-holds-a-key)): the first contender
//! of the queue, whose node carries its instance id (written by the create that joined
//! the queue) and its creation zxid, the fencing token.

use std::sync::Arc;

use tokio::time::{timeout_at, Instant};
use zookeeper_client as zk;

use super::acquire::{backend, ZooKeeperLockError};
use super::keys::{parse_contender, LockPath};
use super::Inner;
use crate::backend::holder::from_unix_millis;
use crate::backend::Holder;
use crate::error::LockError;

impl Inner {
    /// Reads the queue of `path` and its first node, after a sync; nothing written.
    pub(super) async fn holder(
        self: Arc<Self>,
        path: LockPath,
    ) -> Result<Option<Holder>, LockError> {
        let session = self.session().await.map_err(backend)?;
        let client = session
            .client()
            .ok_or_else(|| backend(ZooKeeperLockError::SessionLost))?;
        let limit = Instant::now() + self.config.settings.command_timeout;
        let timed_out = || backend(ZooKeeperLockError::TimedOut("reading the holder"));
        // The session's server may be a follower behind the leader: without the sync,
        // a grant another instance already saw could be missing from the read.
        match timeout_at(limit, client.sync(&path.queue)).await {
            Ok(Ok(())) | Ok(Err(zk::Error::NoNode)) => {}
            Ok(Err(error)) => return Err(backend(ZooKeeperLockError::ZooKeeper(error))),
            Err(_) => return Err(timed_out()),
        }
        let children = match timeout_at(limit, client.list_children(&path.queue)).await {
            Ok(Ok(children)) => children,
            Ok(Err(zk::Error::NoNode)) => return Ok(None),
            Ok(Err(error)) => return Err(backend(ZooKeeperLockError::ZooKeeper(error))),
            Err(_) => return Err(timed_out()),
        };
        // The first contender holds the key; one that left since the listing makes
        // the next one first.
        let mut queue: Vec<_> = children
            .iter()
            .filter_map(|name| parse_contender(name))
            .collect();
        queue.sort_unstable_by_key(|contender| contender.sequence);
        for first in queue {
            match timeout_at(limit, client.get_data(&path.child(first.name))).await {
                Ok(Ok((data, stat))) => {
                    let mut holder = Holder::new();
                    if let Ok(instance) = String::from_utf8(data) {
                        if !instance.is_empty() {
                            holder = holder.with_instance(instance);
                        }
                    }
                    if let Ok(millis) = u64::try_from(stat.ctime) {
                        holder = holder.with_since(from_unix_millis(millis));
                    }
                    if let Ok(zxid) = u64::try_from(stat.czxid) {
                        holder = holder.with_fencing_token(zxid);
                    }
                    return Ok(Some(holder));
                }
                Ok(Err(zk::Error::NoNode)) => continue,
                Ok(Err(error)) => return Err(backend(ZooKeeperLockError::ZooKeeper(error))),
                Err(_) => return Err(timed_out()),
            }
        }
        Ok(None)
    }
}
