//! What the Redis replay store needs of the backend its records share a server with:
//! its identity, its record keys, the write that releases the lock, and its connection.
//! (The acquisition that looks for a record first is the backend's
//! `acquire_unless_recorded`.)

use std::sync::Arc;

use redis::RedisError;
use tokio::time::Instant;

use super::connection::{self, Connection};
use super::keys::RedisKeys;
use super::{scripts, timed_out, RedisBackend};

impl RedisBackend {
    /// Which backend this is (its clones included): a replay record lookup is read
    /// only by the backend it was made for.
    pub(crate) fn engine_id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Where the replay record of `scope` for `key` of the layer `name` lives.
    pub(crate) fn record_key(&self, name: &str, key: &str, scope: &str) -> String {
        RedisKeys::new(&self.inner.config.settings.prefix, name, key).record_of(scope)
    }

    /// Writes `record` as the replay record of `scope` and releases the lock of `key`,
    /// in one script, if the lock is still held by the grant of fencing token `token`:
    /// whether it was. `EVAL`, as a release: one round trip even on a server that lost
    /// its script cache.
    pub(crate) async fn put_and_release(
        &self,
        (name, key, scope): (&str, &str, &str),
        token: u64,
        record: Vec<u8>,
        ttl_ms: u64,
    ) -> Result<bool, RedisError> {
        let keys = RedisKeys::new(&self.inner.config.settings.prefix, name, key);
        let mut command = redis::cmd("EVAL");
        command
            .arg(scripts::PUT_AND_RELEASE)
            .arg(4)
            .arg(&*keys.lock)
            .arg(keys.holder())
            .arg(keys.waiting())
            .arg(keys.record_of(scope))
            .arg(token)
            .arg(record)
            .arg(ttl_ms)
            .arg(&self.inner.channel);
        let written: i64 = self
            .run(|mut connection| async move { command.query_async(&mut connection).await })
            .await?;
        Ok(written == 1)
    }

    /// Runs `command` on the backend's own connection (a single server or a cluster),
    /// within the command timeout: how the Redis replay store reaches the server its
    /// records share with the locks.
    pub(crate) async fn run<T, F>(
        &self,
        command: impl FnOnce(Connection) -> F,
    ) -> Result<T, RedisError>
    where
        F: std::future::Future<Output = Result<T, RedisError>>,
    {
        let limit = Instant::now() + self.inner.config.settings.command_timeout;
        match self.inner.commands.run(limit, true, command).await {
            Ok(value) => Ok(value),
            Err(connection::Failure::Redis(error)) => Err(error),
            Err(connection::Failure::TimedOut) => Err(timed_out("a replay store command")),
        }
    }
}
