//! Who holds a lock (see [Who holds a key](super#who-holds-a-key)): the granting
//! statement writes the holder into its session's `application_name`, which any session
//! can read in `pg_stat_activity` beside the lock in `pg_locks`.

use tokio::time::Instant;

use super::error::PgError;
use super::session::last_row;
use super::Inner;
use crate::backend::holder::from_unix_millis;
use crate::backend::Holder;
use crate::error::LockError;

/// How a holding session's `application_name` starts: `tkl <grant ms> <token or -> <id>`.
const RECORD_TAG: &str = "tkl ";

/// Resets a session's `application_name` to the one it connected with (`set_config`
/// with NULL is `RESET`): the unlock of a session-scope lock ends its holder record so.
pub(super) const RESET_NAME: &str = "set_config('application_name', NULL, false)";

/// The instance id as it can sit in a SQL string literal and in `application_name`:
/// printable ASCII only (PostgreSQL shows other bytes as `?`), `'` doubled.
pub(super) fn instance_literal(instance_id: &str) -> String {
    instance_id
        .chars()
        .map(|c| match c {
            ' '..='~' => c,
            _ => '_',
        })
        .collect::<String>()
        .replace('\'', "''")
}

impl Inner {
    /// The `set_config`, evaluated with the grant (`token` is the column of the fencing
    /// token), that records the holder in `application_name`: for the transaction
    /// (`is_local`), or for the session until the unlock resets it ([`RESET_NAME`]).
    pub(super) fn record_holder_sql(&self, token: &str, is_local: bool) -> String {
        let record = format!(
            "left('{RECORD_TAG}' || (extract(epoch from clock_timestamp()) * 1000)::bigint \
             || ' ' || coalesce({token}::text, '-') || ' ' || '{instance}', 63)",
            instance = self.instance_literal,
        );
        format!("set_config('application_name', {record}, {is_local})")
    }

    /// For a transaction-scoped grant: the fencing token (NULL without fencing), with
    /// the holder recorded until the transaction ends.
    pub(super) fn token_recording_holder_sql(&self) -> String {
        format!(
            "(SELECT token FROM (SELECT token, {holder} FROM (SELECT {token} AS token) \
              AS issued) AS granted)",
            token = self.token_sql(),
            holder = self.record_holder_sql("token", true),
        )
    }

    /// Who holds the advisory lock `id` now: `pg_locks` joined with
    /// `pg_stat_activity`, in one round trip on a pooled connection.
    pub(super) async fn holder(&self, id: i64) -> Result<Option<Holder>, LockError> {
        let bits = id as u64;
        let (high, low) = (bits >> 32, bits & 0xffff_ffff);
        let sql = format!(
            "SELECT a.application_name FROM pg_locks l \
             LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
             AND l.classid::bigint = {high} AND l.objid::bigint = {low} LIMIT 1"
        );
        let session = self
            .session(Instant::now() + self.settings.timing.command_timeout)
            .await?;
        let answer = self
            .round_trip(session.simple_query(&sql))
            .await
            .map_err(PgError::into_lock_error)?;
        let holder = last_row(&answer).map(|row| parse(row.get(0).unwrap_or("")));
        session.give_back();
        Ok(holder)
    }
}

/// A holding session's `application_name` as a [`Holder`]; a name that is not a record
/// (a lock taken by another program) tells nothing.
fn parse(application_name: &str) -> Holder {
    let Some(record) = application_name.strip_prefix(RECORD_TAG) else {
        return Holder::new();
    };
    let mut fields = record.splitn(3, ' ');
    let mut holder = Holder::new();
    if let Some(millis) = fields.next().and_then(|m| m.parse().ok()) {
        holder = holder.with_since(from_unix_millis(millis));
    }
    if let Some(token) = fields.next().and_then(|t| t.parse().ok()) {
        holder = holder.with_fencing_token(token);
    }
    if let Some(instance) = fields.next().filter(|i| !i.is_empty()) {
        holder = holder.with_instance(instance);
    }
    holder
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_other_names_tell_nothing() {
        let holder = parse("tkl 1795683601000 17 web-2:4242");
        assert_eq!(holder.instance(), Some("web-2:4242"));
        assert_eq!(holder.fencing_token(), Some(17));
        assert_eq!(parse("tkl 1795683601000 - a b").fencing_token(), None);
        assert_eq!(parse("tkl 1795683601000 - a b").instance(), Some("a b"));
        assert_eq!(parse("psql"), Holder::new());
        assert_eq!(instance_literal("o'k\nx"), "o''k_x");
    }
}
