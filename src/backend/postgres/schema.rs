//! Creating what the crate keeps in the database (the fencing sequence, the replay
//! table): safe when many instances start at once, and quiet.
//!
//! `CREATE ... IF NOT EXISTS` is neither: two sessions may both find the name free, and
//! the second then fails on a catalog index (`duplicate key value violates unique
//! constraint "pg_type_typname_nsp_index"`); and it sends a NOTICE ("already exists,
//! skipping") on every start.

use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

use super::lock_id::lock_id;
use super::session::last_row;

/// Creates the relation `name` (a checked plain or schema-qualified name) with
/// `create`, its `CREATE` statement without `IF NOT EXISTS`, unless it exists. Looks
/// first, so nothing runs when it is there. Otherwise creates it in one implicit
/// transaction that holds a transaction-scoped advisory lock for `name` and looks
/// again under it, so concurrent creators take turns and only the first creates. A
/// creator that takes no such lock (another program, an older version) can still
/// collide with it: its unique violation or duplicate-table error means "already
/// there".
pub(crate) async fn create_if_missing(
    client: &Client,
    name: &str,
    create: &str,
) -> Result<(), tokio_postgres::Error> {
    let exists = format!("SELECT to_regclass('{name}') IS NOT NULL");
    let answer = client.simple_query(&exists).await?;
    if last_row(&answer).and_then(|row| row.get(0)) == Some("t") {
        return Ok(());
    }
    let lock = lock_id(super::DEFAULT_PREFIX, "schema", name);
    let sql = format!(
        "SELECT pg_advisory_xact_lock({lock}); \
         DO $create$ BEGIN IF to_regclass('{name}') IS NULL THEN {create}; END IF; END \
         $create$"
    );
    match client.simple_query(&sql).await {
        Ok(_) => Ok(()),
        Err(error)
            if error.code() == Some(&SqlState::UNIQUE_VIOLATION)
                || error.code() == Some(&SqlState::DUPLICATE_TABLE) =>
        {
            Ok(())
        }
        Err(error) => Err(error),
    }
}
