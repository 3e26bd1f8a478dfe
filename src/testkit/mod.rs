//! The backend conformance suite, for the crate's own backends and for yours (feature
//! `testkit`).
//!
//! [`MemoryBackend`] is an engine in memory with the whole contract (modes, holders,
//! tokens, leases that a stalled runtime loses) and a hook that takes a key from its
//! holder: test what your application does with a lost lease, without a server.
//!
//! Every [`LockBackend`] of this crate passes these checks against a real server; a
//! backend you write yourself can run the same ones, as tower-sessions lets a session
//! store run its shared suite. Each check starts instances of an application (one
//! [`DistributedLocks`], or for the checks through the layer one
//! [`KeyedLockLayer`](crate::KeyedLockLayer), per backend that [`Deployment::backend`]
//! makes) and panics with a message saying which guarantee broke.
//!
//! ```no_run
//! # #[cfg(feature = "redis")]
//! # mod example {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use tower_keyed_lock::testkit::{self, Deployment};
//! use tower_keyed_lock::{LockBackend, RedisBackend};
//!
//! struct LocalRedis;
//!
//! impl Deployment for LocalRedis {
//!     async fn backend(&self) -> Arc<dyn LockBackend> {
//!         let client = redis::Client::open("redis://127.0.0.1/").unwrap();
//!         let backend = RedisBackend::builder(client)
//!             .lease(Duration::from_secs(1))
//!             .build()
//!             .await
//!             .unwrap();
//!         Arc::new(backend)
//!     }
//!
//!     fn loss_bound(&self) -> Duration {
//!         Duration::from_secs(1)
//!     }
//!
//!     // Every Redis key of the lock name `name` (under the backend's default prefix).
//!     async fn records(&self, name: &str) -> usize {
//!         use redis::AsyncCommands;
//!         let client = redis::Client::open("redis://127.0.0.1/").unwrap();
//!         let mut redis = client.get_multiplexed_async_connection().await.unwrap();
//!         let pattern = format!("*keyed-lock:{name}:*");
//!         let mut keys = redis.scan_match::<_, String>(pattern).await.unwrap();
//!         let mut count = 0;
//!         while let Some(key) = keys.next_item().await {
//!             key.unwrap();
//!             count += 1;
//!         }
//!         count
//!     }
//!
//!     fn record_window(&self) -> Duration {
//!         Duration::ZERO
//!     }
//! }
//!
//! #[tokio::test(flavor = "multi_thread")]
//! async fn my_redis_setup_conforms() {
//!     testkit::run_all(&LocalRedis).await;
//! }
//! # }
//! ```
//!
//! | check | the guarantee |
//! |---|---|
//! | [`one_holder_at_a_time`] | mutual exclusion across instances, nothing lost |
//! | [`busy_and_timeout`] | `try_lock` is `Busy` and `lock_timeout` ends in `Timeout`, never early, while another instance holds |
//! | [`release_hands_over`] | a release wakes the next instance's waiter |
//! | [`fencing_tokens_increase`] | tokens strictly increase from holder to holder; a backend that says it issues none hands out none |
//! | [`dropped_acquisitions_leave_nothing_held`] | a cancelled acquisition, at any point, leaves the key free |
//! | [`a_stalled_holder_sees_its_lease_lost`] | a holder whose runtime stalled while another instance took the key reads `is_lost()` as true, by the clock alone, for the reason `Expired` |
//! | [`a_crashed_holder_is_taken_over`] | a crashed holder's key is free again after the loss bound, whatever the waiters' timeouts |
//! | [`a_released_lease_is_never_renewed`] | no renewal of a released lease touches the key: the next holder keeps its lease for a whole loss bound, and the key is free after its release |
//! | [`renewal_keeps_a_key_held_past_several_leases`] | a running holder keeps its key through another instance's waits of 1.5 loss bounds each, never told it is lost, and its checked release finds the lease its own |
//! | [`several_keys_all_or_nothing`] | `lock_all` of overlapping keys, named in any order, never deadlocks nor overlaps; `try_lock_all` holds none when one is busy |
//! | [`health_answers`] | the health check of a reachable engine is healthy with a round trip, from several instances at once, and leaves nothing held |
//! | [`the_holder_is_read_without_taking_the_key`] | [`DistributedLocks::holder`] is `None` for a free key, names the holder's instance id and fencing token while held, `None` after the release, and never takes or keeps the key |
//! | [`the_deployment_live_run_passes`] | [`DistributedLocks::check_deployment`] runs live on a working engine and passes: a held key refused to a second acquisition, hand-offs, nothing left held, tokens going up where issued |
//! | [`contention_is_reported`] | a guard granted only after another instance released the key says it was [`contended`](crate::DistributedGuard::contended); guards of free keys say they were not |
//! | [`a_key_held_on_another_instance_times_out_with_409`] | through [`KeyedLockLayer`](crate::KeyedLockLayer): a request for a key held on another instance is answered 409 (`problem+json`, `"reason":"timeout"`, `Retry-After`) once its wait is over, not before nor much after |
//! | [`a_client_that_disconnects_while_holding_leaves_no_key`] | through the layer: a request dropped while it holds its key gives the key back well before the loss bound |
//! | [`clients_that_disconnect_while_waiting_leave_no_key`] | through the layer: requests dropped while they wait (at the engine, or in their instance's queue) never run and leave nothing held |
//! | [`released_keys_leave_no_records`] | the server's state follows the keys in use: after [`FOOTPRINT_KEYS`] distinct keys are locked and released and the record window has passed, the namespace holds at most [`MOST_RECORDS_AT_REST`] records |
//!
//! Three checks (the two of renewal, and the slow path) need a running holder's
//! renewals answered in time. On a machine too loaded for that, the holder is told its
//! lease is lost (unreachable, or expired): no breach, but no proof either, so such a
//! check starts over on another key, three attempts at most. A grant the holder was
//! not told of, or a loss to another owner, fails it at once.
//!
//! Backends that hold a key shared and count permits ([`LockBackend::supports`]) also
//! run [`MODE_CHECKS`] ([`run_modes`]):
//!
//! | check | the guarantee |
//! |---|---|
//! | [`readers_hold_together`] | readers of several instances hold a key together; a writer waits for all of them |
//! | [`a_writer_excludes_everyone`] | a writer holds a key alone; a waiting reader gets it after |
//! | [`a_waiting_writer_is_not_starved`] | a waiting writer stops new readers of any instance from entering |
//! | [`at_most_n_permit_holders`] | never more than n permit holders across instances, nothing lost |
//! | [`a_crashed_permit_comes_back`] | a crashed holder's permit is free again after the loss bound |
//! | [`fencing_tokens_across_modes`] | writer tokens increase across modes; a reader's is at least the last writer's and below the next |
//! | [`dropped_shared_and_permit_acquisitions_leave_nothing_held`] | a cancelled shared or permit acquisition, at any point, leaves the key free |
//! | [`exclusive_and_permits_exclude_each_other`] | an exclusive instance and a permit instance under one name exclude each other on a key |
//!
//! Backends whose instances reach their engine over TCP also run [`FAULT_CHECKS`]
//! ([`run_faults`]): implement [`Proxied`] (a backend whose connections go to a given
//! `host:port`), and each check puts a [`FaultProxy`] in one instance's path:
//!
//! | check | the guarantee |
//! |---|---|
//! | [`a_cut_off_holder_is_told_before_another_instance_is_granted`] | a holder whose path went silent (no reset) is told its lease is lost before another instance is granted the key |
//! | [`no_acquisition_outlives_its_wait_on_a_silent_path`] | on a silent path an acquisition fails within its wait plus about one command timeout, and the backend serves again once the path heals |
//! | [`a_slow_path_keeps_the_lease`] | a path a quarter of the command timeout slower each way keeps the lease, and the key, for twice the loss bound |
//! | [`a_reset_connection_is_a_lost_lease_and_recovers`] | a holder whose connections are reset is told before another grant (within [`Proxied::reset_notice`]), and reconnects |
//! | [`the_health_check_fails_on_a_silent_path_and_recovers`] | the health check on a silent path is unhealthy within about one command timeout, and healthy after the heal |
//! | [`a_dropped_path_does_not_end_a_wait`] | a reset, then a silent path, during their waits ends no waiter's wait: all granted in arrival order, one at a time, after the release |
//! | [`an_outage_that_heals_within_the_wait_is_ridden_out`] | an acquisition that starts with its path down (connections reset, connects unanswered) is granted once the path heals within its wait; one dropped while it tries again leaves its key free |
//! | [`abort_on_lease_lost_answers_503`] | through the layer with `abort_on_lease_lost`: a request holding its key on a path gone silent is answered 503 `"reason":"lease_lost"`, and another instance gets the key |

mod contention;
mod deployment;
mod faults;
mod footprint;
mod health;
mod holder;
mod inside;
mod isolated;
mod lateness;
mod layer;
mod lease;
mod memory;
mod modes;
mod mutual;
mod proxy;
mod renewal;
mod several;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use self::contention::contention_is_reported;
pub use self::deployment::the_deployment_live_run_passes;
pub use self::faults::{
    a_cut_off_holder_is_told_before_another_instance_is_granted,
    a_dropped_path_does_not_end_a_wait, a_reset_connection_is_a_lost_lease_and_recovers,
    a_slow_path_keeps_the_lease, an_outage_that_heals_within_the_wait_is_ridden_out,
    no_acquisition_outlives_its_wait_on_a_silent_path,
    the_health_check_fails_on_a_silent_path_and_recovers, FaultProxy, Proxied,
};
pub use self::footprint::{released_keys_leave_no_records, FOOTPRINT_KEYS, MOST_RECORDS_AT_REST};
pub use self::health::health_answers;
pub use self::holder::the_holder_is_read_without_taking_the_key;
pub use self::lateness::Lateness;
pub use self::layer::{
    a_client_that_disconnects_while_holding_leaves_no_key,
    a_key_held_on_another_instance_times_out_with_409, abort_on_lease_lost_answers_503,
    clients_that_disconnect_while_waiting_leave_no_key,
};
pub use self::lease::{
    a_crashed_holder_is_taken_over, a_released_lease_is_never_renewed,
    a_stalled_holder_sees_its_lease_lost,
};
pub use self::memory::{MemoryBackend, DEFAULT_MEMORY_LEASE};
pub use self::modes::{
    a_crashed_permit_comes_back, a_waiting_writer_is_not_starved, a_writer_excludes_everyone,
    at_most_n_permit_holders, dropped_shared_and_permit_acquisitions_leave_nothing_held,
    exclusive_and_permits_exclude_each_other, fencing_tokens_across_modes, readers_hold_together,
};
pub use self::mutual::{
    busy_and_timeout, dropped_acquisitions_leave_nothing_held, fencing_tokens_increase,
    one_holder_at_a_time, release_hands_over,
};
pub use self::renewal::renewal_keeps_a_key_held_past_several_leases;
pub use self::several::several_keys_all_or_nothing;
use crate::backend::{default_instance_id, LostReason};
use crate::{DistributedGuard, DistributedLocks, LockBackend, LockError};

/// Long enough for anything that should happen on a loaded machine: a check fails
/// instead of hanging.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// What the suite needs of a backend set-up: instances that share one engine.
pub trait Deployment: Send + Sync {
    /// A backend for one more instance of the application (its own connections to the
    /// shared engine).
    fn backend(&self) -> impl Future<Output = Arc<dyn LockBackend>> + Send;

    /// The longest a holder that stopped (crashed, stalled, cut off) keeps its key: the
    /// lease for a TTL-lease backend, the liveness bound for a session lock.
    fn loss_bound(&self) -> Duration;

    /// The instance id the backends of [`backend`](Self::backend) record with their
    /// grants (their builders' `instance_id`): what
    /// [`the_holder_is_read_without_taking_the_key`] expects to read back. Default:
    /// [`default_instance_id`], every builder's default.
    fn instance_id(&self) -> String {
        default_instance_id()
    }

    /// How many records the engine keeps for the lock name `name` of this deployment's
    /// backends, counted on the server itself (keys, rows, items, nodes, blobs; held
    /// locks included): what [`released_keys_leave_no_records`] bounds.
    fn records(&self, name: &str) -> impl Future<Output = usize> + Send;

    /// How long after a release the engine may keep a released key's records (the
    /// window its docs give; zero when a release deletes them).
    fn record_window(&self) -> Duration;
}

/// The names of the checks [`run_all`] runs, in its order.
pub const CHECKS: [&str; 18] = [
    "one_holder_at_a_time",
    "busy_and_timeout",
    "release_hands_over",
    "fencing_tokens_increase",
    "dropped_acquisitions_leave_nothing_held",
    "a_stalled_holder_sees_its_lease_lost",
    "a_crashed_holder_is_taken_over",
    "a_released_lease_is_never_renewed",
    "renewal_keeps_a_key_held_past_several_leases",
    "several_keys_all_or_nothing",
    "health_answers",
    "the_holder_is_read_without_taking_the_key",
    "released_keys_leave_no_records",
    "the_deployment_live_run_passes",
    "contention_is_reported",
    "a_key_held_on_another_instance_times_out_with_409",
    "a_client_that_disconnects_while_holding_leaves_no_key",
    "clients_that_disconnect_while_waiting_leave_no_key",
];

/// Runs every check of [`CHECKS`], each on keys of its own.
pub async fn run_all<D: Deployment>(deployment: &D) {
    one_holder_at_a_time(deployment).await;
    busy_and_timeout(deployment).await;
    release_hands_over(deployment).await;
    fencing_tokens_increase(deployment).await;
    dropped_acquisitions_leave_nothing_held(deployment).await;
    a_stalled_holder_sees_its_lease_lost(deployment).await;
    a_crashed_holder_is_taken_over(deployment).await;
    a_released_lease_is_never_renewed(deployment).await;
    renewal_keeps_a_key_held_past_several_leases(deployment).await;
    several_keys_all_or_nothing(deployment).await;
    health_answers(deployment).await;
    the_holder_is_read_without_taking_the_key(deployment).await;
    released_keys_leave_no_records(deployment).await;
    the_deployment_live_run_passes(deployment).await;
    contention_is_reported(deployment).await;
    a_key_held_on_another_instance_times_out_with_409(deployment).await;
    a_client_that_disconnects_while_holding_leaves_no_key(deployment).await;
    clients_that_disconnect_while_waiting_leave_no_key(deployment).await;
}

/// The names of the checks [`run_modes`] runs, in its order: for backends that hold
/// keys shared and count permits.
pub const MODE_CHECKS: [&str; 8] = [
    "readers_hold_together",
    "a_writer_excludes_everyone",
    "a_waiting_writer_is_not_starved",
    "at_most_n_permit_holders",
    "a_crashed_permit_comes_back",
    "fencing_tokens_across_modes",
    "dropped_shared_and_permit_acquisitions_leave_nothing_held",
    "exclusive_and_permits_exclude_each_other",
];

/// Runs every check of [`MODE_CHECKS`], each on keys of its own.
pub async fn run_modes<D: Deployment>(deployment: &D) {
    readers_hold_together(deployment).await;
    a_writer_excludes_everyone(deployment).await;
    a_waiting_writer_is_not_starved(deployment).await;
    at_most_n_permit_holders(deployment).await;
    a_crashed_permit_comes_back(deployment).await;
    fencing_tokens_across_modes(deployment).await;
    dropped_shared_and_permit_acquisitions_leave_nothing_held(deployment).await;
    exclusive_and_permits_exclude_each_other(deployment).await;
}

/// The names of the checks [`run_faults`] runs, in its order: for backends whose
/// instances reach their engine over TCP, through a [`FaultProxy`].
pub const FAULT_CHECKS: [&str; 8] = [
    "a_cut_off_holder_is_told_before_another_instance_is_granted",
    "no_acquisition_outlives_its_wait_on_a_silent_path",
    "a_slow_path_keeps_the_lease",
    "a_reset_connection_is_a_lost_lease_and_recovers",
    "the_health_check_fails_on_a_silent_path_and_recovers",
    "a_dropped_path_does_not_end_a_wait",
    "an_outage_that_heals_within_the_wait_is_ridden_out",
    "abort_on_lease_lost_answers_503",
];

/// Runs every check of [`FAULT_CHECKS`], each on keys of its own.
pub async fn run_faults<P: Proxied>(deployment: &P) {
    a_cut_off_holder_is_told_before_another_instance_is_granted(deployment).await;
    no_acquisition_outlives_its_wait_on_a_silent_path(deployment).await;
    a_slow_path_keeps_the_lease(deployment).await;
    a_reset_connection_is_a_lost_lease_and_recovers(deployment).await;
    the_health_check_fails_on_a_silent_path_and_recovers(deployment).await;
    a_dropped_path_does_not_end_a_wait(deployment).await;
    an_outage_that_heals_within_the_wait_is_ridden_out(deployment).await;
    abort_on_lease_lost_answers_503(deployment).await;
}

/// One instance of the application: locks named like the check, on a fresh backend.
async fn instance<D: Deployment>(deployment: &D, check: &'static str) -> DistributedLocks {
    DistributedLocks::builder(check)
        .shared_backend(deployment.backend().await)
        .build()
}

/// `locks` (another instance) takes `key` from a holder that lost its lease: granted
/// within three [`PATIENCE`]s (the lost lease may run out first), or a panic naming
/// `what`.
async fn taken_over(locks: &DistributedLocks, key: &str, what: &str) -> DistributedGuard {
    within_for(what, 3 * PATIENCE, locks.lock_timeout(key, 3 * PATIENCE))
        .await
        .unwrap_or_else(|error| {
            panic!("conformance: {what}: not granted a key whose lease was lost: {error}")
        })
}

/// `locks` (another instance) takes `key` from a crashed holder with waits of 300 ms
/// at a time, as a user retrying would: granted before `limit` has passed since
/// `crashed`, or a panic naming `what`. What was seen of the dead holder must not be
/// forgotten between acquisitions.
async fn taken_after_crash(
    locks: &DistributedLocks,
    key: &str,
    crashed: Instant,
    limit: Duration,
    what: &str,
) -> DistributedGuard {
    let wait = Duration::from_millis(300);
    let guard = loop {
        let waiting = Instant::now();
        match locks.lock_timeout(key, wait).await {
            Ok(guard) => break guard,
            Err(LockError::Timeout) => {}
            // A wait that ran out while its last look at the engine went unanswered
            // (a loaded machine) ends with that failure: not granted, try again.
            Err(LockError::Backend(_)) if waiting.elapsed() >= wait => {}
            Err(error) => panic!("conformance: lock_timeout failed: {error}"),
        }
        assert!(
            crashed.elapsed() < limit,
            "conformance: {what} was not taken over in {limit:?} of 300 ms waits"
        );
    };
    tracing::info!(took = ?crashed.elapsed(), "conformance: {what} taken over");
    guard
}

/// How many times a check that needs a holder's renewals answered in time starts over
/// after they were not.
const ATTEMPTS_PAST_A_STALL: u32 = 3;

/// Whether a holder told its lease is lost for `reason` was told so because its
/// renewals were not answered in time: the engine did not answer (`Unreachable`), or
/// the deadline passed first, a renewal still on its way or this process stalled
/// (`Expired`). On a machine too loaded to serve the holder that is no breach (the
/// holder was told), but no proof of renewal either. `NotOwner` is never that: the
/// engine answered that someone else has the key.
fn after_a_stall(reason: LostReason) -> bool {
    matches!(reason, LostReason::Unreachable | LostReason::Expired)
}

/// Runs `attempt` on the keys `k1`, `k2`, … until one ends with every renewal of its
/// holders answered in time (`None`). An attempt whose holder was told its lease was
/// lost [`after_a_stall`] returns how long the holder had held its key, and the check
/// starts over; after [`ATTEMPTS_PAST_A_STALL`] such attempts, a panic naming `check`
/// (a backend whose renewal does not work fails every attempt).
async fn starting_over_past_a_stall<F, A>(check: &str, mut attempt: F)
where
    F: FnMut(String) -> A,
    A: Future<Output = Option<Duration>>,
{
    for number in 1..=ATTEMPTS_PAST_A_STALL {
        let Some(held_for) = attempt(format!("k{number}")).await else {
            return;
        };
        tracing::warn!(
            check,
            attempt = number,
            ?held_for,
            "conformance: a holder's renewals were not answered in time, and it was told \
             its lease is lost (a loaded machine); starting over"
        );
    }
    panic!(
        "conformance: {check}: in each of {ATTEMPTS_PAST_A_STALL} attempts a holder's \
         renewals were not answered in time: renewal never kept a lease"
    );
}

/// `future`, or a panic naming `what` after [`PATIENCE`].
async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    within_for(what, PATIENCE, future).await
}

/// `future`, or a panic naming `what` after `limit`.
async fn within_for<T>(what: &str, limit: Duration, future: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, future).await {
        Ok(output) => output,
        Err(_) => panic!("conformance: {what} did not happen within {limit:?}"),
    }
}

/// How long one turn of a check with many contending tasks may wait for its key: the
/// turns of every other task may come first on a loaded engine. A deadlock is caught
/// sooner, by [`while_turns_are_taken`].
const TURN_WAIT: Duration = Duration::from_secs(60);

/// Waits for `tasks`, or panics naming `what` when none of them took a turn (counted
/// in `turns`) for [`PATIENCE`]: many contended turns on a loaded engine take as long
/// as they take, and a deadlock still fails. A task's panic is passed on as it was.
async fn while_turns_are_taken(what: &str, turns: &AtomicUsize, tasks: Vec<JoinHandle<()>>) {
    let mut seen = turns.load(SeqCst);
    for mut task in tasks {
        loop {
            match tokio::time::timeout(PATIENCE, &mut task).await {
                Ok(Ok(())) => break,
                Ok(Err(error)) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                Ok(Err(error)) => panic!("conformance: a task of {what} ended: {error}"),
                Err(_) => {
                    let now = turns.load(SeqCst);
                    assert_ne!(
                        now, seen,
                        "conformance: no turn of {what} was taken for {PATIENCE:?} (a deadlock?)"
                    );
                    seen = now;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{CHECKS, FAULT_CHECKS, MODE_CHECKS};

    /// A check listed is a check run: each runner calls exactly the checks its list
    /// names, in its order (the RELIABILITY table is checked against the lists).
    #[test]
    fn every_listed_check_is_run() {
        let source = include_str!("mod.rs");
        let runners = [
            ("run_all", &CHECKS[..]),
            ("run_modes", &MODE_CHECKS[..]),
            ("run_faults", &FAULT_CHECKS[..]),
        ];
        for (runner, listed) in runners {
            let body = source
                .split(&format!("pub async fn {runner}<"))
                .nth(1)
                .and_then(|rest| rest.split("\n}\n").next())
                .expect("the runner is defined here");
            let run: Vec<&str> = body
                .lines()
                .filter_map(|line| line.trim().strip_suffix("(deployment).await;"))
                .collect();
            assert_eq!(run, listed, "{runner} runs what its list names, in order");
        }
    }
}
