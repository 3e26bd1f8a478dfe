//! Who holds a key (see [The item](super#the-item)): the holder's instance id and grant
//! time, written by the granting update with the owner token, and read back with a
//! strongly consistent `GetItem`.

use std::collections::HashMap;
use std::time::SystemTime;

use aws_sdk_dynamodb::types::AttributeValue;

use super::item::{FENCE, OWNER};
use super::Inner;
use crate::backend::holder::from_unix_millis;
use crate::backend::ttl::PolledRecord as _;
use crate::backend::Holder;
use crate::error::LockError;

/// The instance id of the holder, written with each grant.
pub(super) const INSTANCE: &str = "lock_instance";
/// When the holder was granted the key: milliseconds since the epoch, on the granting
/// instance's clock (DynamoDB has no server time to write).
pub(super) const SINCE_MS: &str = "lock_since_ms";

impl Inner {
    /// Reads the lock item of `item_key`, strongly consistent, within the command
    /// timeout.
    pub(super) async fn holder(
        &self,
        item_key: HashMap<String, AttributeValue>,
    ) -> Result<Option<Holder>, LockError> {
        let read = self
            .client
            .get_item()
            .table_name(&self.layout.table)
            .set_key(Some(item_key))
            .consistent_read(true)
            .send();
        let output = match tokio::time::timeout(self.config.settings.command_timeout, read).await {
            Ok(Ok(output)) => output,
            Ok(Err(error)) => return Err(self.named(Box::new(error))),
            Err(_) => return Err(self.named(self.no_answer())),
        };
        Ok(output.item().and_then(from_item))
    }
}

/// The holder in a lock item, `None` when the item is free (no owner).
fn from_item(item: &HashMap<String, AttributeValue>) -> Option<Holder> {
    item.get(OWNER)?;
    let number = |name: &str| match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse::<u64>().ok(),
        _ => None,
    };
    let mut holder = Holder::new();
    if let Some(AttributeValue::S(instance)) = item.get(INSTANCE) {
        holder = holder.with_instance(instance.clone());
    }
    if let Some(millis) = number(SINCE_MS) {
        holder = holder.with_since(from_unix_millis(millis));
    }
    if let Some(fence) = number(FENCE) {
        holder = holder.with_fencing_token(fence);
    }
    // No renewal time is stored (waiters watch the record version instead): the lease
    // left is not known, only that it is at most the lease.
    Some(holder)
}

/// The grant time to write now.
pub(super) fn since_now() -> String {
    crate::backend::holder::unix_millis(SystemTime::now()).to_string()
}
