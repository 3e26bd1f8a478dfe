//! Who holds a key (see [Who holds a key](super#who-holds-a-key)): the blob's lease
//! state, and the metadata the holder wrote under its new lease with the fencing token.

use azure_core::http::StatusCode;
use azure_storage_blob::models::{BlobClientGetPropertiesResultHeaders, LeaseState};
use azure_storage_blob::BlobClient;
use tokio::time::timeout;

use super::metadata::{FENCE, INSTANCE, SINCE_MS};
use super::Inner;
use crate::backend::holder::from_unix_millis;
use crate::backend::ttl::PolledRecord as _;
use crate::backend::Holder;
use crate::error::LockError;

impl Inner {
    /// One `Get Blob Properties`: nothing leased, nothing written.
    pub(super) async fn holder(&self, blob: BlobClient) -> Result<Option<Holder>, LockError> {
        let failed = |error: azure_core::Error| self.named(Box::new(error));
        let properties = match timeout(self.config.command_timeout, blob.get_properties(None)).await
        {
            Ok(Ok(properties)) => properties,
            Ok(Err(error)) if error.http_status() == Some(StatusCode::NotFound) => return Ok(None),
            Ok(Err(error)) => return Err(failed(error)),
            Err(_) => return Err(self.named(self.no_answer())),
        };
        if !matches!(
            properties.lease_state().map_err(failed)?,
            Some(LeaseState::Leased | LeaseState::Breaking)
        ) {
            return Ok(None);
        }
        let metadata = properties.metadata().map_err(failed)?;
        let mut holder = Holder::new();
        if let Some(instance) = metadata.get(INSTANCE) {
            holder = holder.with_instance(instance.clone());
        }
        if let Some(millis) = metadata.get(SINCE_MS).and_then(|m| m.parse().ok()) {
            holder = holder.with_since(from_unix_millis(millis));
        }
        if let Some(fence) = metadata.get(FENCE).and_then(|f| f.parse().ok()) {
            holder = holder.with_fencing_token(fence);
        }
        Ok(Some(holder))
    }
}
