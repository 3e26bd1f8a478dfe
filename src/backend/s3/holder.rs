//! Who holds a key (see [Who holds a key](super#who-holds-a-key)): the lock object's
//! record, read with one `GetObject`.

use tokio::time::Instant;

use super::Inner;
use crate::backend::holder::from_unix_millis;
use crate::backend::ttl::PolledRecord as _;
use crate::backend::Holder;
use crate::error::LockError;

impl Inner {
    /// One `GetObject`: nothing written.
    pub(super) async fn holder(&self, object: String) -> Result<Option<Holder>, LockError> {
        let cap = Instant::now() + self.config.command_timeout;
        let found = self
            .read(&object, cap)
            .await
            .map_err(|error| self.named(error.error))?;
        let Some(found) = found else {
            return Ok(None);
        };
        let record = found.record;
        if record.owner.is_none() {
            return Ok(None);
        }
        let mut holder = Holder::new().with_fencing_token(record.fence);
        if let Some(instance) = record.instance {
            holder = holder.with_instance(instance);
        }
        if let Some(millis) = record.since_ms {
            holder = holder.with_since(from_unix_millis(millis));
        }
        // S3 keeps no expiry: a holder is one until a waiter takes it over, so the
        // lease left is not known.
        Ok(Some(holder))
    }
}
