//! Who holds a key (see [Who holds a key](super#who-holds-a-key)): the blob's lease
//! state, and the metadata the holder wrote under its new lease with the fencing token.

use std::collections::HashMap;

use azure_core::http::StatusCode;
use azure_storage_blob::models::{BlobClientGetPropertiesResultHeaders, LeaseState};
use azure_storage_blob::BlobClient;
use tokio::time::timeout;

use super::lease::{AzureBlobLockError, FENCE};
use super::Inner;
use crate::backend::{from_unix_millis, unix_millis, Holder};
use crate::error::LockError;

/// The metadata entry with the holder's instance id.
pub(super) const INSTANCE: &str = "holder";
/// The metadata entry with the grant time, ms since the epoch (the holder's clock).
pub(super) const SINCE_MS: &str = "since_ms";

/// The metadata written with a grant: the fencing token, instance id and grant time.
pub(super) fn grant_metadata(fence: u64, instance_id: &str) -> HashMap<String, String> {
    HashMap::from([
        (FENCE.to_owned(), fence.to_string()),
        (INSTANCE.to_owned(), instance_id.to_owned()),
        (
            SINCE_MS.to_owned(),
            unix_millis(std::time::SystemTime::now()).to_string(),
        ),
    ])
}

impl Inner {
    /// One `Get Blob Properties`: nothing leased, nothing written.
    pub(super) async fn holder(&self, blob: BlobClient) -> Result<Option<Holder>, LockError> {
        let failed = |error: azure_core::Error| self.named(Box::new(error));
        let properties = match timeout(self.config.command_timeout, blob.get_properties(None)).await
        {
            Ok(Ok(properties)) => properties,
            Ok(Err(error)) if error.http_status() == Some(StatusCode::NotFound) => return Ok(None),
            Ok(Err(error)) => return Err(failed(error)),
            Err(_) => {
                let limit = self.config.command_timeout;
                return Err(self.named(Box::new(AzureBlobLockError::CommandTimeout(limit))));
            }
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
