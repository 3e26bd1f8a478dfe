//! What a Redis deployment means for the locks, read for the deployment check: the
//! eviction policy, persistence and what a restart means for the restart guard, the
//! replicas a failover could promote, and the server's clock.

use std::time::{Duration, SystemTime};

use redis::{InfoDict, RedisError};
use tokio::time::Instant;

use super::connection::{Connection, Failure};
use super::{eviction, Inner};
use crate::backend::Finding;

/// The configuration findings of the Redis behind `inner`, each read within two
/// command timeouts; one that got no answer says so.
pub(super) async fn findings(inner: &Inner) -> Vec<Finding> {
    let limit = || Instant::now() + inner.commands.timeout() * 2;
    let policies = inner.commands.run(limit(), false, eviction::policies).await;
    let mut findings = vec![eviction_policy(policies.map_err(unread_because))];
    // Persistence and replicas are read on one server; a cluster's nodes are each
    // their own, which this check does not walk.
    if inner.commands.is_single() {
        let read = inner.commands.run(limit(), false, server_state).await;
        match read {
            Ok(state) => {
                findings.push(persistence(&state, inner.config.restart_guard));
                findings.push(replicas(&state, inner.config.replicas.is_some()));
            }
            Err(failure) => findings.push(unread("persistence", unread_because(failure))),
        }
    }
    let read_at = SystemTime::now();
    let sent = Instant::now();
    let time = inner.commands.run(limit(), false, server_time).await;
    findings.push(clock_offset(time.map_err(unread_because), read_at, sent));
    findings
}

/// The `eviction_policy` finding of what the servers' policies read as, or why they
/// could not be read. (Redlock's masters too.)
pub(in crate::backend) fn eviction_policy(
    read: Result<Vec<(Option<String>, String)>, String>,
) -> Finding {
    const CHECK: &str = "eviction_policy";
    const WHY: &str = "under any policy but noeviction, Redis drops keys under memory \
        pressure, a held lock among them, and grants it to another instance before its \
        holder is told";
    match read {
        Ok(policies) => match eviction::problem(policies) {
            None => Finding::pass(CHECK, "maxmemory-policy noeviction", WHY),
            Some(problem) => Finding::fail(
                CHECK,
                problem,
                WHY,
                "set `maxmemory-policy noeviction` on every server that holds locks (a Redis of its own for locks, if a cache needs eviction)",
            ),
        },
        Err(why) => unread(CHECK, why),
    }
}

/// What `CONFIG GET` and `INFO` say of persistence and replication.
struct ServerState {
    /// `appendonly` and `appendfsync`, `None` where `CONFIG` is not allowed.
    append_only: Option<(String, String)>,
    /// `save` (the snapshot schedule), `None` where `CONFIG` is not allowed.
    save: Option<String>,
    /// `role` (`master` or `slave`).
    role: String,
    /// `connected_slaves` on a primary.
    replicas: u32,
}

async fn server_state(mut connection: Connection) -> Result<ServerState, RedisError> {
    let config = |parameter: &'static str| {
        let mut connection = connection.clone();
        async move {
            let pair: Result<(String, String), RedisError> = redis::cmd("CONFIG")
                .arg("GET")
                .arg(parameter)
                .query_async(&mut connection)
                .await;
            pair.ok().map(|(_, value)| value)
        }
    };
    let append_only = match (config("appendonly").await, config("appendfsync").await) {
        (Some(on), Some(fsync)) => Some((on, fsync)),
        _ => None,
    };
    let save = config("save").await;
    let info: InfoDict = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut connection)
        .await?;
    Ok(ServerState {
        append_only,
        save,
        role: info.get("role").unwrap_or_else(|| "unknown".to_owned()),
        replicas: info.get("connected_slaves").unwrap_or(0),
    })
}

fn persistence(state: &ServerState, restart_guard: bool) -> Finding {
    const CHECK: &str = "persistence";
    let saw = match (&state.append_only, &state.save) {
        (Some((on, fsync)), Some(save)) => {
            let save = if save.is_empty() { "off" } else { save };
            format!("appendonly {on} (appendfsync {fsync}), snapshots: {save}")
        }
        _ => "not readable (CONFIG is not allowed)".to_owned(),
    };
    if restart_guard {
        return Finding::pass(
            CHECK,
            saw,
            "after a restart, empty or from an older snapshot, Redis may have forgotten a \
             held lock; the restart guard (on) grants nothing until a lease has passed since \
             the start, so that lock's holder has given up first, and fencing tokens carry on \
             from the server's clock, never back",
        );
    }
    let durable =
        matches!(&state.append_only, Some((on, fsync)) if on == "yes" && fsync == "always");
    let why = "the restart guard is off: a Redis restarted empty or from an older snapshot \
        grants a lock its holder still counts as held";
    match durable {
        true => Finding::pass(CHECK, saw, "every write is on disk before it is answered (appendfsync always), so a restart keeps every held lock"),
        false => Finding::fail(
            CHECK,
            saw,
            why,
            "turn the restart guard back on (RedisBackendBuilder::restart_guard(true), the default), or run Redis with appendonly yes and appendfsync always",
        ),
    }
}

fn replicas(state: &ServerState, waits_for_replicas: bool) -> Finding {
    const CHECK: &str = "replicas";
    let saw = format!(
        "role {}, {} connected replica(s)",
        state.role, state.replicas
    );
    if state.role != "master" {
        return Finding::fail(
            CHECK,
            saw,
            "a replica refuses writes: no lock can be granted here",
            "point the backend at the primary (with Sentinel, at the master it names)",
        );
    }
    if state.replicas == 0 || waits_for_replicas {
        let why = match waits_for_replicas {
            true => "every grant and renewal waits for the replicas' acknowledgement (WAIT), so a failover to one of them keeps it",
            false => "no replica to fail over to: a failover cannot lose a lock",
        };
        return Finding::pass(CHECK, saw, why);
    }
    Finding::warn(
        CHECK,
        saw,
        "Redis replicates asynchronously: a failover to a replica that had not yet received a \
         grant loses that lock, and grants it again while its holder still counts it as held",
        "RedisBackendBuilder::wait_for_replicas(n, timeout) so that a grant counts only once replicas have it, or Redlock over independent primaries",
    )
}

/// The `clock_offset` finding of a `TIME` sent at `sent` (`read_at` on the wall clock).
pub(in crate::backend) fn clock_offset(
    time: Result<SystemTime, String>,
    read_at: SystemTime,
    sent: Instant,
) -> Finding {
    match time {
        Ok(server) => {
            let round_trip = sent.elapsed();
            // TIME is in µs: half the round trip is the whole uncertainty.
            Finding::clock_offset(server, read_at + round_trip / 2, round_trip / 2)
        }
        Err(why) => unread("clock_offset", why),
    }
}

/// `TIME`: the server's clock.
pub(in crate::backend) async fn server_time(
    mut connection: Connection,
) -> Result<SystemTime, RedisError> {
    let (seconds, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut connection).await?;
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_micros(micros))
}

fn unread_because(failure: Failure) -> String {
    match failure {
        Failure::Redis(error) => error.to_string(),
        Failure::TimedOut => "no answer within two command timeouts".to_owned(),
    }
}

fn unread(check: &'static str, why: String) -> Finding {
    Finding::warn(
        check,
        format!("could not be read: {why}"),
        "the check could not tell",
        "check that Redis answers and that this user may run CONFIG GET, INFO and TIME",
    )
}
