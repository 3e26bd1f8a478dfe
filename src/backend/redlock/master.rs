//! One Redis master: its connection (the Redis backend's, replaced when it goes
//! silent) and the three commands Redlock sends it.

use std::time::{Duration, SystemTime};

use redis::{Client, RedisError};
use tokio::time::Instant;

use super::scripts::{ACQUIRE, RELEASE as RELEASE_TEXT};

/// This backend's acquire and release, by SHA1.
static ACQUIRE_SCRIPT: std::sync::LazyLock<CachedScript> =
    std::sync::LazyLock::new(|| CachedScript::new(ACQUIRE));
static RELEASE: std::sync::LazyLock<CachedScript> =
    std::sync::LazyLock::new(|| CachedScript::new(RELEASE_TEXT));

/// How long data sent to a master may stay unacknowledged before the kernel gives up
/// on the connection and closes it (`TCP_USER_TIMEOUT`, the backstop for a dead path):
/// a command not delivered by then never reaches the master.
pub(super) fn give_up(command_timeout: Duration) -> Duration {
    (command_timeout * 10).max(Duration::from_secs(5))
}

/// The holder record of a lock held for `ttl_ms`: as long again after the lock's own
/// expiry (a crashed holder's record goes by itself a lease later; a release deletes
/// it at once; every renewal extends it with the lock).
fn holder_record_ttl_ms(ttl_ms: u64) -> u64 {
    ttl_ms.saturating_mul(2)
}
use crate::backend::redis::cached::CachedScript;
use crate::backend::redis::connection::{with_tcp_settings, Commands, Failure, Target};
use crate::backend::redis::keys::RedisKeys;
use crate::backend::redis::scripts::{HOLDER, RENEW};
use crate::backend::Finding;

/// What one master answered to an acquire attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Vote {
    /// `SET NX PX` went through: the key is ours on this master.
    Granted,
    /// Held by another token, which expires in this many ms (negative: unknown).
    Held { ttl_ms: i64 },
    /// Up for less than a lease: it votes for nobody for this many ms more.
    Restarted { wait_ms: u64 },
    /// No answer within the limit, or an error: it may have granted.
    NoAnswer,
    /// The connection was refused (the master is down): nothing was sent, so nothing
    /// granted.
    Refused,
}

/// What one master answered to a renewal or a give-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reply {
    /// The token held the key: extended (renewal) or deleted (give-back).
    Ours,
    /// The token does not hold the key there.
    NotOurs,
    /// No answer within the limit, or an error.
    NoAnswer,
    /// The connection was refused: the master is down, and what it held expires by
    /// its TTL (or went with it).
    Down,
}

pub(super) struct Master {
    /// `host:port`, for logs and errors.
    pub(super) address: String,
    commands: Commands,
    command_timeout: Duration,
}

impl Master {
    /// A lazily connected master: the first command connects.
    pub(super) fn new(client: &Client, command_timeout: Duration) -> Result<Self, RedisError> {
        let address = client.get_connection_info().addr().to_string();
        // The kernel's backstop for a dead path, as for the Redis backend.
        let client = with_tcp_settings(client, give_up(command_timeout))?;
        Ok(Self {
            address,
            commands: Commands::new(Target::Single(client), command_timeout)?,
            command_timeout,
        })
    }

    /// `PING`, bounded by the command timeout.
    pub(super) async fn ping(&self) -> Result<(), RedisError> {
        let limit = Instant::now() + self.command_timeout;
        self.run(limit, |mut connection| async move {
            redis::cmd("PING").query_async::<()>(&mut connection).await
        })
        .await
    }

    /// The `maxmemory-policy` check of the Redis backend, on this master.
    pub(super) async fn check_eviction(&self, allowed: bool) -> Result<(), String> {
        let limit = Instant::now() + 2 * self.command_timeout;
        let policies = self
            .run(limit, crate::backend::redis::eviction::policies)
            .await;
        crate::backend::redis::eviction::check(policies, allowed)
    }

    /// This master's findings for the deployment check: its eviction policy and its
    /// clock.
    pub(super) async fn findings(&self) -> [Finding; 2] {
        use crate::backend::redis::deployment::{clock_offset, eviction_policy, server_time};

        let limit = Instant::now() + 2 * self.command_timeout;
        let policies = self
            .run(limit, crate::backend::redis::eviction::policies)
            .await;
        let mut eviction = eviction_policy(policies.map_err(|error| error.to_string()));
        let read_at = SystemTime::now();
        let sent = Instant::now();
        let time = self.run(sent + 2 * self.command_timeout, server_time).await;
        let mut clock = clock_offset(time.map_err(|error| error.to_string()), read_at, sent);
        for finding in [&mut eviction, &mut clock] {
            finding.saw = format!("{}: {}", self.address, finding.saw);
        }
        [eviction, clock]
    }

    /// One acquire attempt on this master; the error, if it gave no vote.
    pub(super) async fn acquire(
        &self,
        keys: &RedisKeys,
        token: &str,
        ttl_ms: u64,
        restart_guard_ms: u64,
        limit: Instant,
        instance_id: &str,
    ) -> (Vote, Option<RedisError>) {
        let rest_bytes = instance_id.len() + 64;
        let command = token_command(&ACQUIRE_SCRIPT, keys, token, rest_bytes, |command| {
            command
                .arg(ttl_ms)
                .arg(restart_guard_ms)
                .arg(instance_id)
                .arg(holder_record_ttl_ms(ttl_ms));
        });
        let answer = self
            .run(limit, |mut connection| async move {
                ACQUIRE_SCRIPT
                    .run::<(i64, i64)>(&command, &mut connection)
                    .await
            })
            .await;
        match answer {
            Ok((1, _)) => (Vote::Granted, None),
            Ok((2, wait_ms)) => {
                let wait_ms = u64::try_from(wait_ms).unwrap_or_default();
                (Vote::Restarted { wait_ms }, None)
            }
            Ok((_, ttl_ms)) => (Vote::Held { ttl_ms }, None),
            // Refused: the master is down, and the attempt never left this process.
            Err(error) if error.is_connection_refusal() => (Vote::Refused, Some(error)),
            Err(error) => {
                tracing::debug!(master = %self.address, %error, "redlock attempt unanswered");
                (Vote::NoAnswer, Some(error))
            }
        }
    }

    /// Extends `token`'s hold on the lock to `ttl_ms` if it still holds it, and its
    /// holder record with it. `EVAL`, not `EVALSHA`: a master that lost its script
    /// cache would cost a round trip more.
    pub(super) async fn renew(
        &self,
        keys: &RedisKeys,
        token: &str,
        ttl_ms: u64,
        limit: Instant,
    ) -> Reply {
        let mut command = redis::cmd("EVAL");
        command
            .arg(RENEW)
            .arg(2)
            .arg(&*keys.lock)
            .arg(keys.holder())
            .arg(token)
            .arg(ttl_ms)
            .arg(holder_record_ttl_ms(ttl_ms));
        let renewed = self
            .run(limit, |mut connection| async move {
                command.query_async::<i64>(&mut connection).await
            })
            .await;
        match renewed {
            Ok(1) => Reply::Ours,
            Ok(_) => Reply::NotOurs,
            Err(_) => Reply::NoAnswer,
        }
    }

    /// Deletes the lock if `token` holds it; otherwise marks the token given back for
    /// `mark_ms`, so a late attempt of it grants nothing here.
    pub(super) async fn release(&self, keys: &RedisKeys, token: &str, mark_ms: u64) -> Reply {
        let command = token_command(&RELEASE, keys, token, 32, |command| {
            command.arg(mark_ms);
        });
        let limit = Instant::now() + self.command_timeout;
        let released = self
            .run(limit, |mut connection| async move {
                RELEASE.run::<i64>(&command, &mut connection).await
            })
            .await;
        match released {
            Ok(1) => Reply::Ours,
            Ok(_) => Reply::NotOurs,
            Err(error) if error.is_connection_refusal() => Reply::Down,
            Err(error) => {
                tracing::debug!(master = %self.address, %error, "redlock release unanswered");
                Reply::NoAnswer
            }
        }
    }

    /// This master's view of the lock: `None` when free, else the holder's token, the
    /// lock's PTTL and, if the record is that token's, the rest of the record (grant
    /// ms, fencing token, instance id; one per line).
    pub(super) async fn holder(
        &self,
        keys: &RedisKeys,
    ) -> Result<Option<(String, i64, Option<String>)>, RedisError> {
        let mut command = redis::cmd("EVAL");
        command
            .arg(HOLDER)
            .arg(2)
            .arg(&*keys.lock)
            .arg(keys.holder());
        let limit = Instant::now() + self.command_timeout;
        let answer: Vec<redis::Value> = self
            .run(limit, |mut connection| async move {
                command.query_async(&mut connection).await
            })
            .await?;
        let mut answer = answer.into_iter();
        let Some(token) = answer.next() else {
            return Ok(None);
        };
        let token: String = redis::from_redis_value(token)?;
        let pttl: i64 = answer
            .next()
            .map(redis::from_redis_value)
            .transpose()?
            .unwrap_or(-1);
        let rest: Option<String> = answer.next().map(redis::from_redis_value).transpose()?;
        Ok(Some((token, pttl, rest)))
    }

    /// Runs `command` until `limit`; only a whole command timeout counts towards
    /// replacing a silent connection.
    async fn run<T, F>(
        &self,
        limit: Instant,
        command: impl FnOnce(crate::backend::redis::connection::Connection) -> F,
    ) -> Result<T, RedisError>
    where
        F: std::future::Future<Output = Result<T, RedisError>>,
    {
        let counts = limit >= Instant::now() + self.command_timeout / 2;
        match self.commands.run(limit, counts, command).await {
            Ok(value) => Ok(value),
            Err(Failure::Redis(error)) => Err(error),
            Err(Failure::TimedOut) => Err(RedisError::from((
                redis::ErrorKind::Io,
                "timed out",
                format!("no answer from {} in time", self.address),
            ))),
        }
    }
}

/// A call of the acquire or release script, which share their keys and first argument
/// (`KEYS[1]` the lock, `KEYS[2]` `token`'s given-back mark, `KEYS[3]` the holder
/// record; `ARGV[1]` `token`); `rest` adds the script's other arguments, about
/// `rest_bytes` long.
fn token_command(
    script: &CachedScript,
    keys: &RedisKeys,
    token: &str,
    rest_bytes: usize,
    rest: impl FnOnce(&mut redis::Cmd),
) -> redis::Cmd {
    let bytes = 2 * keys.lock.len() + keys.holder().len() + 3 * token.len() + rest_bytes;
    script.command(bytes, |command| {
        command
            .arg(3)
            .arg(&*keys.lock)
            .arg(keys.given_back(token))
            .arg(keys.holder())
            .arg(token);
        rest(command);
    })
}
