//! The blob's metadata: the last fencing token issued for the key, and who holds it
//! since when (see [Who holds a key](super#who-holds-a-key)).

use std::collections::HashMap;

use crate::backend::holder::unix_millis;

/// The blob metadata entry that holds the last fencing token issued for the key.
pub(super) const FENCE: &str = "fence";
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
