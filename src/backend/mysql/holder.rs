//! Whether a key is held (see [Who holds a key](super#who-holds-a-key)):
//! `IS_USED_LOCK`, on a pooled connection.

use tokio::time::Instant;

use super::lock_name::hex_literal;
use super::session::number;
use super::Inner;
use crate::backend::Holder;
use crate::locks::LockError;

impl Inner {
    /// One round trip: `IS_USED_LOCK(name)`, the holding connection's id or NULL.
    pub(super) async fn holder(&self, name: String) -> Result<Option<Holder>, LockError> {
        let mut session = self
            .session(Instant::now() + self.settings.timing.command_timeout)
            .await?;
        let sql = format!("SELECT IS_USED_LOCK({})", hex_literal(&name));
        let rows = session
            .rows(&sql, self.settings.timing.command_timeout)
            .await
            .map_err(|error| error.into_lock_error())?;
        let held = rows.last().and_then(|row| number(row, 0)).is_some();
        session.give_back();
        // The server knows only the holding connection: no instance id, grant time,
        // fencing token or lease (see the module docs).
        Ok(held.then(Holder::new))
    }
}
