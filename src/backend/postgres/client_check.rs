//! The server's look at a closed client connection during a lock wait
//! (`client_connection_check_interval`, PostgreSQL 14 and later), set on the backend's
//! sessions where the server allows it.
//!
//! PostgreSQL does not otherwise notice a closed connection while a statement waits
//! for a lock: a wait whose acquisition was dropped stays queued until it is granted —
//! ahead of live waiters, which then wait for the dead one to end — or until its
//! `lock_timeout`, keeping a server process all along. With the setting the server ends
//! such a session within [`CLIENT_CHECK_INTERVAL`]. A look is one `poll` while a
//! statement runs, none while the session is idle.
//!
//! Whether it may be set is probed once per backend, not assumed: some managed services
//! refuse the setting, and a refused `set_config` in a lock statement would fail every
//! acquisition.

use std::time::Duration;

use tokio::time::Instant;

use super::session::last_row;
use super::Inner;
use crate::error::LockError;

/// How often the server looks at a waiting session's client connection.
pub(super) const CLIENT_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// The setting's name.
pub(super) const CLIENT_CHECK: &str = "client_connection_check_interval";

/// `set_config` of the client check, `local` to the transaction or for the session.
pub(super) fn set_client_check_sql(local: bool) -> String {
    format!(
        "set_config('{CLIENT_CHECK}', '{}ms', {local})",
        CLIENT_CHECK_INTERVAL.as_millis()
    )
}

impl Inner {
    /// Whether the lock statements set the client check; probed on the first call (and
    /// again after a failure that was not the server's refusal).
    pub(super) async fn probe_client_check(&self, deadline: Instant) -> Result<bool, LockError> {
        if let Some(sets) = self.client_check.get() {
            return Ok(*sets);
        }
        let probe = async {
            let session = self.session(deadline).await?;
            // Local to the probe's own statement: the pooled session is left as it was.
            let sql = format!(
                "SELECT CASE WHEN current_setting('{CLIENT_CHECK}', true) IS NOT NULL \
                             THEN {} END",
                set_client_check_sql(true)
            );
            match self.round_trip(session.simple_query(&sql)).await {
                Ok(answer) => {
                    session.give_back();
                    // NULL: a server before 14, without the setting.
                    Ok(last_row(&answer).and_then(|row| row.get(0)).is_some())
                }
                // An error answer on a session still open: the server refuses the
                // setting. A cut dropped wait then ends at its grant or lock_timeout.
                Err(error) if error.code.is_some() && !error.closed && !session.is_closed() => {
                    tracing::info!(
                        %error,
                        "PostgreSQL refuses {CLIENT_CHECK}: a dropped acquisition's wait stays \
                         queued until granted or until its lock_timeout"
                    );
                    session.give_back();
                    Ok(false)
                }
                Err(error) => Err(error.into_lock_error()),
            }
        };
        // Boxed: the probe's future is not carried by every acquisition's.
        Box::pin(self.client_check.get_or_try_init(|| probe))
            .await
            .copied()
    }

    /// Whether the lock statements set the client check: as probed (never before).
    pub(super) fn sets_client_check(&self) -> bool {
        self.client_check.get().copied().unwrap_or(false)
    }
}
