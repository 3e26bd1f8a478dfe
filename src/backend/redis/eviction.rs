//! The eviction check: under any `maxmemory-policy` but `noeviction`, Redis may drop a
//! held lock key under memory pressure and grant it to another instance before its
//! holder is told. Run when a backend is built, and again while it runs (`watch`): a
//! policy changed later (`CONFIG SET`, a restart with another configuration) is
//! noticed within one re-read interval, or soon after a reconnection.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, ErrorKind, RedisError, Value};
use tokio::sync::watch;
use tokio::time::{sleep, Instant};

use super::connection::{Commands, Connection};

/// The longest between two re-reads of the policy while a backend runs (lease/3 if
/// shorter): the window in which a policy changed to an evicting one goes unnoticed.
/// One `CONFIG GET` per backend per interval, whatever the number of locks.
pub(in crate::backend) const MAX_RECHECK_INTERVAL: Duration = Duration::from_secs(5);

/// How soon a re-read that got no answer (Redis down, reconnecting) is tried again.
const RETRY_UNREAD: Duration = Duration::from_secs(1);

/// What the last read of the policies found: `None` while every server runs
/// `noeviction`, else what may evict (for logs, errors and the health check).
pub(in crate::backend) type EvictionState = watch::Receiver<Option<Arc<str>>>;

/// The only policy under which Redis never drops a key before its TTL.
const NOEVICTION: &str = "noeviction";

/// The `maxmemory-policy` of each server that grants locks: one, or every primary of a
/// cluster (by address). Read with `CONFIG GET`, or from `INFO memory` where `CONFIG`
/// is renamed or not allowed (managed services often do that).
pub(in crate::backend) async fn policies(
    connection: Connection,
) -> Result<Vec<(Option<String>, String)>, RedisError> {
    match connection {
        Connection::Single(mut connection) => {
            let config = config_get().query_async::<Value>(&mut connection).await;
            let policy = match config.and_then(from_config) {
                Ok(policy) => policy,
                Err(_) => from_info(info_memory().query_async(&mut connection).await?)?,
            };
            Ok(vec![(None, policy)])
        }
        Connection::Cluster(mut connection) => {
            let primaries = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
            let answers = connection
                .route_command(config_get(), primaries.clone())
                .await?;
            let config: Result<Vec<_>, RedisError> = by_node(answers)?
                .into_iter()
                .map(|(node, answer)| Ok((Some(node), from_config(answer)?)))
                .collect();
            if let Ok(policies) = config {
                return Ok(policies);
            }
            let answers = connection.route_command(info_memory(), primaries).await?;
            by_node(answers)?
                .into_iter()
                .map(|(node, answer)| Ok((Some(node), from_info(answer)?)))
                .collect()
        }
    }
}

/// Refuses unless every policy is `noeviction` or the risk was accepted (then warns):
/// the refusal says what and the fix. A policy that could not be read at all is refused
/// the same way: it may evict.
pub(in crate::backend) fn check(
    read: Result<Vec<(Option<String>, String)>, RedisError>,
    allowed: bool,
) -> Result<(), String> {
    let problem = match read {
        Ok(policies) => match problem(policies) {
            None => return Ok(()),
            Some(problem) => problem,
        },
        Err(error) => format!("the maxmemory-policy of Redis could not be read ({error})"),
    };
    if allowed {
        tracing::warn!(
            "{problem}: a held lock key may be evicted under memory pressure and \
             granted to another instance before its holder is told \
             (allow_unsafe_eviction_policy is on)"
        );
        return Ok(());
    }
    Err(refusal_text(&problem))
}

/// What may evict among `policies`, or `None` if every one is `noeviction`.
pub(super) fn problem(policies: Vec<(Option<String>, String)>) -> Option<String> {
    let evicting: Vec<String> = policies
        .into_iter()
        .filter(|(_, policy)| policy != NOEVICTION)
        .map(|(node, policy)| match node {
            Some(node) => format!("maxmemory-policy {policy} on primary {node}"),
            None => format!("maxmemory-policy {policy}"),
        })
        .collect();
    (!evicting.is_empty()).then(|| format!("Redis runs with {}", evicting.join(", ")))
}

/// The error of a build, or of an acquisition, refused because of `problem`.
pub(in crate::backend) fn refusal(problem: &str) -> RedisError {
    RedisError::from((
        ErrorKind::InvalidClientConfig,
        "Redis may evict lock keys",
        refusal_text(problem),
    ))
}

/// Why `problem` is refused, and the fix.
fn refusal_text(problem: &str) -> String {
    format!(
        "{problem}: under memory pressure a held lock key can be evicted and granted to \
         another instance before its holder is told. Set `maxmemory-policy noeviction` on \
         every server that holds locks (a Redis of its own for locks, if a cache needs \
         eviction), or accept the risk with \
         RedisBackendBuilder::allow_unsafe_eviction_policy(true)"
    )
}

/// How often a running backend with leases of `lease` re-reads the policy.
pub(in crate::backend) fn recheck_interval(lease: Duration) -> Duration {
    (lease / 3).min(MAX_RECHECK_INTERVAL)
}

/// Starts re-reading the policy of the servers behind `commands` every `interval`,
/// and at once after the connection broke or was replaced (a reconnection may reach a
/// server restarted with another configuration). Begins from what the build found
/// (nothing, unless the risk was `allowed`). A read that gets no answer changes
/// nothing (an unreachable Redis is the leases' deadlines' business) and is tried
/// again within [`RETRY_UNREAD`]. Ends with the backend (`commands` is only
/// borrowed between reads).
pub(in crate::backend) fn watch(
    commands: &Arc<Commands>,
    interval: Duration,
    allowed: bool,
) -> EvictionState {
    let (state, receiver) = watch::channel(None);
    let trouble = commands.trouble();
    let commands = Arc::downgrade(commands);
    tokio::spawn(async move {
        let mut pause = interval;
        // After a read that got no answer, only the pause: the failed read itself
        // notified `trouble`.
        let mut answered = true;
        loop {
            tokio::select! {
                () = sleep(pause) => {}
                () = trouble.notified(), if answered => {}
                () = state.closed() => return,
            }
            let Some(read) = read_again(&commands).await else {
                return;
            };
            let found = match read {
                Ok(policies) => problem(policies),
                Err(error) => {
                    tracing::debug!(%error, "re-reading the redis maxmemory-policy failed");
                    pause = interval.min(RETRY_UNREAD);
                    answered = false;
                    continue;
                }
            };
            (pause, answered) = (interval, true);
            let changed = state.borrow().as_deref() != found.as_deref();
            if changed {
                match (&found, allowed) {
                    (Some(problem), false) => tracing::warn!(
                        "{problem}: a held lock key may be evicted under memory pressure; \
                         every lease of this backend is declared lost and no lock is \
                         granted until every server runs maxmemory-policy noeviction"
                    ),
                    (Some(problem), true) => tracing::warn!(
                        "{problem}: a held lock key may be evicted under memory pressure \
                         and granted to another instance before its holder is told \
                         (allow_unsafe_eviction_policy is on)"
                    ),
                    (None, _) => tracing::info!(
                        "Redis runs with maxmemory-policy noeviction again: locks are granted"
                    ),
                }
                state.send_replace(found.map(Arc::from));
            }
        }
    });
    receiver
}

/// One read of the policies through `commands`, within two command timeouts (`CONFIG
/// GET`, then `INFO` where `CONFIG` is not allowed); `None` once the backend is gone.
async fn read_again(
    commands: &Weak<Commands>,
) -> Option<Result<Vec<(Option<String>, String)>, RedisError>> {
    let commands = commands.upgrade()?;
    let limit = Instant::now() + commands.timeout() * 2;
    let read = commands.run(limit, false, policies).await;
    Some(read.map_err(|failure| match failure {
        super::connection::Failure::Redis(error) => error,
        super::connection::Failure::TimedOut => {
            RedisError::from((ErrorKind::Io, "timed out reading maxmemory-policy"))
        }
    }))
}

fn config_get() -> Cmd {
    let mut command = redis::cmd("CONFIG");
    command.arg("GET").arg("maxmemory-policy");
    command
}

fn info_memory() -> Cmd {
    let mut command = redis::cmd("INFO");
    command.arg("memory");
    command
}

/// `CONFIG GET`'s answer: a map (RESP3) or a flat list of pairs (RESP2).
fn from_config(answer: Value) -> Result<String, RedisError> {
    let mut pairs: HashMap<String, String> = redis::from_redis_value(answer.extract_error()?)?;
    pairs
        .remove("maxmemory-policy")
        .ok_or_else(|| unreadable("CONFIG GET returned no maxmemory-policy"))
}

/// The `maxmemory_policy:` line of `INFO memory`.
fn from_info(answer: Value) -> Result<String, RedisError> {
    let text: String = redis::from_redis_value(answer.extract_error()?)?;
    text.lines()
        .find_map(|line| line.strip_prefix("maxmemory_policy:"))
        .map(|policy| policy.trim().to_owned())
        .ok_or_else(|| unreadable("INFO memory has no maxmemory_policy"))
}

/// A multi-node answer of a cluster: address → that node's answer.
fn by_node(answers: Value) -> Result<Vec<(String, Value)>, RedisError> {
    let Value::Map(pairs) = answers else {
        return Err(unreadable("a cluster answered without a map of nodes"));
    };
    pairs
        .into_iter()
        .map(|(node, answer)| Ok((redis::from_redis_value(node)?, answer)))
        .collect()
}

fn unreadable(what: &'static str) -> RedisError {
    RedisError::from((ErrorKind::Parse, what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_memory_gives_the_policy() {
        let info = "# Memory\r\nused_memory:1\r\nmaxmemory_policy:allkeys-lru\r\n";
        let answer = Value::BulkString(info.as_bytes().to_vec());
        assert_eq!(from_info(answer).unwrap(), "allkeys-lru");
    }

    #[test]
    fn only_noeviction_passes_unless_allowed() {
        let policies = |policy: &str| Ok(vec![(Some("n:1".to_owned()), policy.to_owned())]);
        assert!(check(policies("noeviction"), false).is_ok());
        let refused = check(policies("volatile-ttl"), false).unwrap_err();
        let message = refused.to_string();
        assert!(message.contains("volatile-ttl on primary n:1"), "{message}");
        assert!(
            message.contains("allow_unsafe_eviction_policy(true)"),
            "{message}"
        );
        assert!(check(policies("volatile-ttl"), true).is_ok());
        assert!(check(Err(unreadable("no answer")), false).is_err());
    }
}
