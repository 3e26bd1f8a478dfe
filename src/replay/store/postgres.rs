//! The PostgreSQL store: a table of records, writes ordered by fencing token.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::OnceCell;

use crate::backend::postgres::schema::create_if_missing;

use super::{Get, Put, RecordKey, ReplayStore, StoreError, Stored};
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
/// ([`fencing(true)`](crate::backend::postgres::PostgresBackend::fencing)): under a
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
        })
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

    /// Deletes up to [`PURGE_EVERY`] expired rows on `client`, off the request's path.
    fn purge_batch_in_background(&self, client: deadpool_postgres::Object) {
        let statements = self.statements.clone();
        tokio::spawn(async move {
            if let Err(error) = client.execute(&statements.purge_batch, &[]).await {
                tracing::debug!(%error, "purging expired replay records failed");
            }
        });
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
            put: format!(
                "INSERT INTO {table} AS t (layer, key, scope, fence, record, expires_at) \
                 VALUES ($1, $2, $3, $4, $5, now() + $6::bigint * interval '1 millisecond') \
                 ON CONFLICT (layer, key, scope) DO UPDATE \
                 SET fence = EXCLUDED.fence, record = EXCLUDED.record, \
                     expires_at = EXCLUDED.expires_at \
                 WHERE t.fence < EXCLUDED.fence"
            ),
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
            let client = store.client().await?;
            let row = client
                .query_opt(
                    &store.statements.get,
                    &[&key.layer(), &key.key(), &key.scope()],
                )
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
                StoreError::new("the PostgreSQL replay store needs fencing tokens: PostgresBackend::fencing(true)")
            })?;
            let fence = i64::try_from(token).map_err(StoreError::new)?;
            // Capped at 100 years: PostgreSQL intervals overflow long before `i64::MAX` ms.
            let ttl_ms = i64::try_from(ttl.as_millis()).map_or(MAX_TTL_MS, |ms| ms.min(MAX_TTL_MS));
            let client = store.client().await?;
            let written = client
                .execute(
                    &store.statements.put,
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
            if store.writes.fetch_add(1, Ordering::Relaxed) % PURGE_EVERY == PURGE_EVERY - 1 {
                store.purge_batch_in_background(client);
            }
            Ok(if written == 1 {
                Stored::Written
            } else {
                Stored::Fenced
            })
        })
    }

    fn needs_fencing_tokens(&self) -> bool {
        true
    }
}

impl std::fmt::Debug for PostgresReplayStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresReplayStore")
            .finish_non_exhaustive()
    }
}
