//! The PostgreSQL store: a table of records, writes ordered by fencing token.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::OnceCell;
use tokio_postgres::Statement;

use crate::backend::postgres::schema::create_if_missing;

use super::{Get, Put, RecordKey, ReplayStore, StoreError, Stored};
use crate::backend::{Place, RecordLookup, RecordWrite, ReleaseLease};
use crate::replay::record::Record;

/// The default table name.
pub const DEFAULT_TABLE: &str = "keyed_lock_replay";

const MAX_TTL_MS: i64 = 100 * 365 * 24 * 60 * 60 * 1000;

/// Every this many writes, one write also deletes up to this many expired rows: the
/// table stays as large as the records alive, with no task to schedule.
const PURGE_EVERY: u64 = 256;

/// Records in a PostgreSQL table, created on first use if missing (under an advisory
/// lock, so instances that start together do not collide, and without a NOTICE when it
/// exists):
///
/// ```sql
/// CREATE TABLE keyed_lock_replay (
///     layer      text        NOT NULL,  -- the lock layer's name
///     key        text        NOT NULL,  -- the request key
///     scope      text        NOT NULL,  -- hex SHA-256 of method, route, path, query, principal
///     fence      bigint      NOT NULL,  -- the fencing token of the writer
///     record     bytea       NOT NULL,  -- Record::to_bytes
///     expires_at timestamptz NOT NULL,
///     PRIMARY KEY (layer, key, scope)
/// )
/// ```
///
/// A write is one conditional upsert: it inserts, or replaces a row whose `fence` is
/// lower than the writer's token, so a holder whose lock was lost never overwrites its
/// successor's record. It needs the fencing tokens of the PostgreSQL backend
/// ([`fencing(true)`](crate::backend::postgres::PostgresBackendBuilder::fencing)): under a
/// backend without them it could never store, so
/// [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay) refuses it (a panic naming
/// the fix), and layers stacked by hand answer 500 (misconfigured) before the handler
/// runs. A stale holder can still insert a record where none exists yet; the
/// successor's write replaces it. Rows past `expires_at` are never returned, and
/// deleted as the store is used: every 256th write also deletes up to 256 expired rows
/// (in the background). [`purge_expired`](Self::purge_expired) deletes them all at once.
///
/// Give the store its own pool: the lock backend's connections sit idle holding locks.
#[derive(Clone)]
pub struct PostgresReplayStore {
    pool: Pool,
    statements: Arc<Statements>,
    created: Arc<OnceCell<()>>,
    /// Writes so far, by every clone: when to purge a batch.
    writes: Arc<AtomicU64>,
    /// The backend whose acquisitions look records up ([`looked_up_by`](Self::looked_up_by)).
    looked_up_by: Option<usize>,
}

struct Statements {
    table: String,
    create: String,
    get: String,
    put: String,
    purge: String,
    purge_batch: String,
}

impl PostgresReplayStore {
    /// A store in table [`DEFAULT_TABLE`], through `pool`.
    pub fn new(pool: Pool) -> Self {
        Self::with_table(pool, DEFAULT_TABLE).expect("the default table name is valid")
    }

    /// A store in `table` (letters, digits and `_`, optionally `schema.table`), through
    /// `pool`. Fails on any other name.
    pub fn with_table(pool: Pool, table: &str) -> Result<Self, StoreError> {
        let plain = |part: &str| {
            !part.is_empty()
                && part.len() <= 63
                && !part.starts_with(|c: char| c.is_ascii_digit())
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        };
        if !table.split('.').all(plain) || table.split('.').count() > 2 {
            return Err(StoreError::new(format!(
                "not a plain table name: {table:?}"
            )));
        }
        Ok(Self {
            pool,
            statements: Arc::new(Statements::for_table(table)),
            created: Arc::new(OnceCell::new()),
            writes: Arc::new(AtomicU64::new(0)),
            looked_up_by: None,
        })
    }

    /// Has the acquisitions of `backend` (its clones included) look this store's
    /// records up, under [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay): the
    /// lock's try reads the request's record in its own round trip and takes nothing
    /// when it is there, so a completed request is replayed in one round trip, and a
    /// first request is known as one without a read of its own; its record is then
    /// written on the lock's own session, sent with the unlock: one round trip after
    /// the handler, and nothing after the answer. The table must be in `backend`'s
    /// database; session locks only (the default
    /// [`LockScope`](crate::backend::postgres::LockScope)).
    ///
    /// ```no_run
    /// use tower_keyed_lock::backend::postgres::PostgresBackend;
    /// use tower_keyed_lock::replay::{PostgresReplayStore, ReplayLayer};
    /// use tower_keyed_lock::KeyedLockLayer;
    ///
    /// # async fn run(pool: deadpool_postgres::Pool) -> Result<(), Box<dyn std::error::Error>> {
    /// let backend = PostgresBackend::builder_from_str("host=db user=app")?
    ///     .fencing(true)
    ///     .build()
    ///     .await?;
    /// let store = PostgresReplayStore::new(pool).looked_up_by(&backend);
    /// let layer = KeyedLockLayer::by_header("idempotency-key")
    ///     .backend(backend)
    ///     .replay(ReplayLayer::new(store));
    /// # let _ = layer;
    /// # Ok(())
    /// # }
    /// ```
    pub fn looked_up_by(mut self, backend: &crate::backend::postgres::PostgresBackend) -> Self {
        self.looked_up_by = Some(backend.engine_id());
        self
    }

    /// The SQL expression of `key`'s unexpired record (its bytes, or NULL), for the
    /// lock's try (a simple query: no parameters). The values are literals the primary
    /// key's index answers (a `convert_from(decode(..))` of hex was a sequential scan
    /// of the whole table), dollar-quoted so nothing in a key can reach the SQL.
    fn record_sql(&self, key: &RecordKey) -> String {
        format!(
            "(SELECT record FROM {table} WHERE layer = {layer} AND key = {key} \
              AND scope = {scope} AND expires_at > now())",
            table = self.statements.table,
            layer = dollar_quoted(key.layer()),
            key = dollar_quoted(key.key()),
            scope = dollar_quoted(key.scope()),
        )
    }

    /// Deletes the expired rows; returns how many. Run it now and then (expired rows
    /// are already never replayed).
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        client
            .execute(&self.statements.purge, &[])
            .await
            .map_err(StoreError::new)
    }

    /// Counts a write; every [`PURGE_EVERY`]th deletes up to as many expired rows, on
    /// a pooled connection, off the request's path.
    fn count_write(&self) {
        if self.writes.fetch_add(1, Ordering::Relaxed) % PURGE_EVERY != PURGE_EVERY - 1 {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            let purged = match store.pool.get().await {
                Ok(client) => client.execute(&store.statements.purge_batch, &[]).await,
                Err(error) => {
                    return tracing::debug!(%error, "purging expired replay records failed")
                }
            };
            if let Err(error) = purged {
                tracing::debug!(%error, "purging expired replay records failed");
            }
        });
    }

    /// The fenced upsert of `record` under `key`, as one simple query (literals only:
    /// the lease sends it on its session with the unlock); the bytes as hex, which
    /// reads the same whatever `standard_conforming_strings` says.
    fn put_sql(&self, key: &RecordKey, fence: i64, record: &[u8], ttl_ms: i64) -> String {
        let hex: String = record.iter().map(|byte| format!("{byte:02x}")).collect();
        upsert(
            &self.statements.table,
            [
                &dollar_quoted(key.layer()),
                &dollar_quoted(key.key()),
                &dollar_quoted(key.scope()),
                &fence.to_string(),
                &format!("decode('{hex}', 'hex')"),
                &ttl_ms.to_string(),
            ],
        )
    }

    /// A pooled connection, after the table exists.
    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        let client = self.pool.get().await.map_err(StoreError::new)?;
        self.created
            .get_or_try_init(|| async {
                let statements = &self.statements;
                create_if_missing(&client, &statements.table, &statements.create)
                    .await
                    .map_err(StoreError::new)
            })
            .await?;
        Ok(client)
    }

    /// A pooled connection, as [`client`](Self::client), with `sql` prepared on it
    /// (once per connection).
    async fn prepared(
        &self,
        sql: &str,
    ) -> Result<(deadpool_postgres::Object, Statement), StoreError> {
        let client = self.client().await?;
        let statement = client.prepare_cached(sql).await.map_err(StoreError::new)?;
        Ok((client, statement))
    }
}

/// The fenced upsert into `table` of a record: its layer, key, scope, fence, bytes and
/// TTL in milliseconds, as SQL. It inserts, or replaces a row whose fence is lower.
fn upsert(table: &str, [layer, key, scope, fence, record, ttl_ms]: [&str; 6]) -> String {
    format!(
        "INSERT INTO {table} AS t (layer, key, scope, fence, record, expires_at) \
         VALUES ({layer}, {key}, {scope}, {fence}, {record}, \
                 now() + {ttl_ms}::bigint * interval '1 millisecond') \
         ON CONFLICT (layer, key, scope) DO UPDATE \
         SET fence = EXCLUDED.fence, record = EXCLUDED.record, \
             expires_at = EXCLUDED.expires_at \
         WHERE t.fence < EXCLUDED.fence"
    )
}

impl Statements {
    fn for_table(table: &str) -> Self {
        Self {
            table: table.to_owned(),
            create: format!(
                "CREATE TABLE {table} (\
                   layer text NOT NULL, key text NOT NULL, scope text NOT NULL, \
                   fence bigint NOT NULL, record bytea NOT NULL, \
                   expires_at timestamptz NOT NULL, PRIMARY KEY (layer, key, scope))"
            ),
            get: format!(
                "SELECT record FROM {table} \
                 WHERE layer = $1 AND key = $2 AND scope = $3 AND expires_at > now()"
            ),
            put: upsert(table, ["$1", "$2", "$3", "$4", "$5", "$6"]),
            purge: format!("DELETE FROM {table} WHERE expires_at <= now()"),
            purge_batch: format!(
                "DELETE FROM {table} WHERE ctid = ANY(ARRAY(\
                   SELECT ctid FROM {table} WHERE expires_at <= now() LIMIT {PURGE_EVERY}))"
            ),
        }
    }
}

impl ReplayStore for PostgresReplayStore {
    fn get(&self, key: &RecordKey) -> Get {
        let store = self.clone();
        let key = key.clone();
        Box::pin(async move {
            // Prepared once per connection: a read is one round trip.
            let (client, get) = store.prepared(&store.statements.get).await?;
            let row = client
                .query_opt(&get, &[&key.layer(), &key.key(), &key.scope()])
                .await
                .map_err(StoreError::new)?;
            row.map(|row| Record::from_bytes(row.get::<_, &[u8]>(0)))
                .transpose()
        })
    }

    fn put(&self, key: &RecordKey, record: Record, ttl: Duration, token: Option<u64>) -> Put {
        let store = self.clone();
        let key = key.clone();
        Box::pin(async move {
            let token = token.ok_or_else(|| {
                StoreError::new("the PostgreSQL replay store needs fencing tokens: PostgresBackendBuilder::fencing(true)")
            })?;
            let (fence, ttl_ms) = fence_and_ttl(token, ttl)?;
            let (client, put) = store.prepared(&store.statements.put).await?;
            let written = client
                .execute(
                    &put,
                    &[
                        &key.layer(),
                        &key.key(),
                        &key.scope(),
                        &fence,
                        &record.to_bytes(),
                        &ttl_ms,
                    ],
                )
                .await
                .map_err(StoreError::new)?;
            drop(client);
            store.count_write();
            Ok(Stored::from_written(written == 1))
        })
    }

    fn needs_fencing_tokens(&self) -> bool {
        true
    }

    /// With [`looked_up_by`](Self::looked_up_by), on that backend's lease: the fenced
    /// upsert is handed to the lease, which sends it with the unlock on the lock's own
    /// session, in one round trip (the write is committed before the unlock runs; a
    /// write that fails is still followed by the unlock).
    fn put_and_release(
        &self,
        key: &RecordKey,
        record: &Record,
        ttl: Duration,
        token: u64,
        release: &dyn ReleaseLease,
    ) -> Option<Put> {
        let engine = self.looked_up_by?;
        let (fence, ttl_ms) = fence_and_ttl(token, ttl).ok()?;
        let sql = self.put_sql(key, fence, &record.to_bytes(), ttl_ms);
        let written = release.release_writing(RecordWrite {
            place: Place::Postgres { engine, sql },
        })?;
        let store = self.clone();
        Some(Box::pin(async move {
            let written = written.await.map_err(StoreError::new)?;
            store.count_write();
            Ok(Stored::from_written(written))
        }))
    }

    /// With [`looked_up_by`](Self::looked_up_by), once the table is known to exist (a
    /// try that named a missing table would fail).
    fn lookup(&self, key: &RecordKey) -> Option<RecordLookup> {
        let engine = self.looked_up_by?;
        self.created.initialized().then(|| RecordLookup {
            place: Place::Postgres {
                engine,
                sql: self.record_sql(key),
            },
        })
    }
}

/// A token as the table's `fence`, and `ttl` in milliseconds, capped at 100 years
/// (PostgreSQL intervals overflow long before `i64::MAX` ms).
fn fence_and_ttl(token: u64, ttl: Duration) -> Result<(i64, i64), StoreError> {
    let fence = i64::try_from(token).map_err(StoreError::new)?;
    let ttl_ms = i64::try_from(ttl.as_millis()).map_or(MAX_TTL_MS, |ms| ms.min(MAX_TTL_MS));
    Ok((fence, ttl_ms))
}

/// `value` as a dollar-quoted SQL string constant, `$t<n>$…$t<n>$`, with the first tag
/// that does not occur in it: taken as it is, whatever its quotes and backslashes and
/// whatever `standard_conforming_strings` says. (A key has no NUL: control characters
/// are refused.)
fn dollar_quoted(value: &str) -> String {
    let tag = (0..)
        .map(|n| format!("$t{n}$"))
        .find(|tag| !value.contains(tag.as_str()))
        .expect("some tag is not in the value");
    format!("{tag}{value}{tag}")
}

impl std::fmt::Debug for PostgresReplayStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresReplayStore")
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::dollar_quoted;

    #[test]
    fn dollar_quoting_picks_a_tag_the_value_does_not_hold() {
        assert_eq!(dollar_quoted("order-1"), "$t0$order-1$t0$");
        assert_eq!(dollar_quoted(r"a'b\c"), r"$t0$a'b\c$t0$");
        assert_eq!(dollar_quoted("x$t0$y"), "$t1$x$t0$y$t1$");
        assert_eq!(dollar_quoted("$t0$$t1$"), "$t2$$t0$$t1$$t2$");
    }
}
