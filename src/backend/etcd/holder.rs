//! Who holds a key (see [Who holds a key](super#who-holds-a-key)): the oldest key of
//! the queue, whose value is the holder's instance id (put by the transaction that
//! joined the queue), whose create revision is the fencing token, and whose etcd
//! lease tells the time left.

use std::sync::Arc;

use etcd_client::{GetOptions, SortOrder, SortTarget};
use tokio::time::timeout;

use super::failure::EtcdLockError;
use super::keys::LockKeys;
use super::Inner;
use crate::backend::Holder;
use crate::error::LockError;

impl Inner {
    /// Two reads: the queue's oldest key, then its lease's time to live.
    pub(super) async fn holder(
        self: Arc<Self>,
        keys: LockKeys,
    ) -> Result<Option<Holder>, LockError> {
        let failed = |error: etcd_client::Error| LockError::Backend(Box::new(error));
        let timed_out =
            || LockError::Backend(Box::new(EtcdLockError::TimedOut("reading the holder")));
        let oldest = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let mut kv = self.client.kv_client();
        let found = timeout(
            self.config.command_timeout,
            kv.get(keys.queue.as_bytes(), Some(oldest)),
        )
        .await
        .map_err(|_| timed_out())?
        .map_err(failed)?;
        let Some(first) = found.kvs().first() else {
            return Ok(None);
        };
        let mut holder = Holder::new();
        if let Ok(instance) = first.value_str() {
            if !instance.is_empty() {
                holder = holder.with_instance(instance);
            }
        }
        if let Ok(revision) = u64::try_from(first.create_revision()) {
            holder = holder.with_fencing_token(revision);
        }
        let mut leases = self.client.lease_client();
        let lease = first.lease();
        if let Ok(Ok(live)) = timeout(
            self.config.command_timeout,
            leases.time_to_live(lease, None),
        )
        .await
        {
            // Whole seconds, as etcd counts them; -1 once the lease is gone.
            if let Ok(seconds) = u64::try_from(live.ttl()) {
                holder = holder.with_lease_left(std::time::Duration::from_secs(seconds));
            }
        }
        Ok(Some(holder))
    }
}
