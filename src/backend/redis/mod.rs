//! Redis backend: serializes a key across every instance that shares a Redis server.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{routing::post, Router};
//! use tower_keyed_lock::backend::redis::RedisBackend;
//! use tower_keyed_lock::KeyedLockLayer;
//!
//! # async fn pay() {}
//! # async fn app() -> Result<Router, Box<dyn std::error::Error>> {
//! let backend = RedisBackend::builder(redis::Client::open("redis://127.0.0.1/")?)
//!     .lease(Duration::from_secs(10))
//!     .build()
//!     .await?;
//! let app = Router::new().route("/orders/{order_id}/pay", post(pay)).layer(
//!     KeyedLockLayer::by_path("order_id")
//!         .name("orders")
//!         .wait_timeout(Duration::from_secs(2))
//!         .backend(backend),
//! );
//! # Ok(app)
//! # }
//! ```
//!
//! # How a key is held
//!
//! - **Acquire.** One Lua script runs `SET lock token NX PX lease` with a fresh
//!   128-bit token and, when granted, issues the key's fencing token
//!   ([`LockInfo::fencing_token`](crate::LockInfo::fencing_token)): `max(last + 1,
//!   server time in µs)`, stored with the holder record, which keeps the key's last
//!   token. When the key is held
//!   it returns the holder's remaining TTL instead. An attempt whose answer never comes
//!   (error, timeout, or the acquire future dropped) may still have been granted, or be
//!   run later (a frozen server runs what waits in its sockets when it wakes), so its
//!   token is released in the background, retried until Redis answers (every quarter
//!   lease at most, for up to a minute or a lease if longer): the acquire is
//!   cancel-safe by itself. A release that finds the key not held by its token marks
//!   the token given back for a minute (or a lease, if longer), and the acquire script
//!   grants nothing to a marked token: an attempt delayed on a connection since
//!   replaced, delivered after its release, does not block the key for a lease.
//! - **Wait.** Each backend keeps one pub/sub subscription to a release channel (on a
//!   cluster, to the shard channel of each lock it waits for). A
//!   waiter retries when a release of its key is announced there, or else after a
//!   jittered [`poll_interval`](RedisBackendBuilder::poll_interval) capped by the
//!   holder's remaining TTL, until the request's wait is over. A lost message only costs
//!   latency: the poll finds the key free.
//! - **Hand-off.** A refused writer also queues (`:queue`: its token, with the lease,
//!   fence TTL and instance id to be granted with), and a release hands the key to the
//!   first writer still waiting, in the release script itself: it grants as the
//!   acquire script would (fencing token, holder record) and announces `lock`, token,
//!   fencing token and lease on the channel. That waiter holds the key without a round
//!   trip of its own; its lease counts from the send time of its last attempt, which
//!   was refused and so ran before the grant. The other waiters wait on, retrying when
//!   that lease would be over at the latest. If the message is lost, the waiter's next
//!   attempt finds the key its own (and extends it from then). A waiter that stops
//!   waiting (its wait over, its future dropped) gives its token back as for an
//!   unanswered attempt: that takes it out of the queue, or hands on the key it was
//!   granted meanwhile. A waiter whose instance dies (or is cut off) while queued
//!   cannot: a release within its entry's life (`poll_interval` + `command_timeout`
//!   after its last attempt) grants it the key, which is then free one lease later.
//!   A writer that does not wait (`try_lock`, a zero wait) never queues: a grant
//!   would find it gone. Waiters that look for a replay record first, and backends
//!   that `WAIT` for replicas, do not queue either: a record stored meanwhile must be
//!   found, and a grant must be acknowledged; they take the key with an attempt of
//!   their own. Neither does an instance of an earlier version, which does not read
//!   grant messages either: during a rolling upgrade it polls while queued writers
//!   are handed the key, and its releases delete the key as before.
//! - **Validity.** The lease counts as valid until *send time of the last successful
//!   acquire or renewal + lease − drift margin*, on the monotonic clock. At that instant
//!   it is declared lost (even if Redis never answers again), as it is at the first
//!   reply saying the key is no longer ours; the handler sees it through
//!   [`LockInfo::lease`](crate::LockInfo::lease).
//! - **Renewal.** While held, a task renews every lease/3 with a compare-and-`PEXPIRE`
//!   script, and stops when the lease is released, dropped or lost, or at
//!   [`max_hold`](RedisBackendBuilder::max_hold). The task starts at the first renewal:
//!   until then the lease waits in the backend's one renewal schedule, whose task also
//!   watches the eviction policy for it, so a lease released sooner costs no task.
//! - **Release.** A compare-and-delete script (or hand-off, above) that also
//!   `PUBLISH`es (on a cluster `SPUBLISH`es) the release when a waiter marked the key
//!   (a failed acquire leaves the mark; an uncontended release publishes nothing). If Redis cannot be reached within the command timeout, the
//!   release is retried in the background, and at worst the key expires by its lease.
//!
//! Every command is bounded by [`command_timeout`](RedisBackendBuilder::command_timeout).
//! Only the wait bounds the waiting: an acquire attempt that got no answer (a command
//! timeout, a broken or refused connection, an answer out of turn) is tried again,
//! with a fresh token and a jittered backoff, until the request's wait ends (a zero
//! wait tries once, with a whole command timeout). When Redis is down or silent for
//! the whole wait, the acquisition then fails with [`LockError::Backend`] (the last
//! failure) and the layer answers 503 (or runs the request under its local lock with
//! [`fail_open`](crate::KeyedLockLayer::fail_open)); a wait whose last attempt was
//! answered "held" ends with [`LockError::Timeout`].
//!
//! # What one lock costs
//!
//! An uncontended exclusive lock, acquired and released with the defaults (fencing,
//! holder record, restart guard, renewal on), is two round trips: the acquire script
//! and the release script, each sent by its SHA1 (`EVALSHA`; the text goes once more
//! only after the server lost its script cache). A hold longer than lease/3 adds one
//! renewal script per lease/3. Inside Redis, each command has one purpose:
//!
//! | script | command | what for |
//! |---|---|---|
//! | acquire | `EXISTS` (3 keys) | a given-back mark (a late attempt of a token given back grants nothing), readers, permit holders: one call, each looked at only if it exists |
//! | acquire | `TIME` | the fencing token's floor (server µs) and the holder record's time |
//! | acquire | `SET lock token NX PX` | the lock itself |
//! | acquire | `LASTSAVE` | restart guard, once `SET NX` granted (a refusal deletes that grant): time since the last save bounds the uptime from below (`INFO server` only within a lease of a start or save) |
//! | acquire | `GET` + `SET` holder record | the fencing token, `max(last + 1, µs)`, and who holds it (for [`holder`](LockBackend::holder)), with the record window |
//! | release | `GET` lock | compare: only the token's holder releases |
//! | release | `EXISTS` queue | hand-off to a writer queued on another instance |
//! | release | `DEL` lock and waiting mark | the release, and whether a waiter must be told (2 deleted: `PUBLISH`, only then) |
//! | renewal | `GET`, `PEXPIRE` ×2 | compare, then the lock and holder record extended together |
//!
//! A contended key adds, for the refused writer, its waiting mark, intent and queue
//! entry (`SET`, `ZADD`, `HSET` and their TTLs) and the release's hand-off to it; the
//! `redis` bench prints the counts (`INFO commandstats`).
//!
//! # Connections
//!
//! Commands go through a [`ConnectionManager`](redis::aio::ConnectionManager), which
//! reconnects when its connection closes. A connection can also go silent without
//! closing (a partition, a dead NAT or load-balancer entry: no reset ever comes), so
//! after 3 command timeouts in a row, with no answer at all for 2 command timeouts,
//! the manager is replaced by a fresh one, which connects anew: a silent path costs
//! two to three command timeouts, not the minutes TCP takes to give up. A slow but
//! answering connection (an overloaded server or process) is kept: a reconnection
//! would only add to the load, and the commands in flight on it would be lost. The subscription is pinged
//! every second; a ping unanswered within the command timeout, or a closed connection,
//! makes it resubscribe on a new connection, and every waiter then retries once (a
//! release may have gone unheard). Sockets get TCP keepalive and, on Linux,
//! `TCP_USER_TIMEOUT` (10 command timeouts, at least 5 s) as the kernel's backstop.
//!
//! # Restarts and lost writes
//!
//! Redis can lose writes: a restart without persistence comes back empty, one from an
//! RDB snapshot or an `appendfsync everysec` log comes back as it was a moment (or
//! minutes) earlier, and an asynchronous replica promoted by a failover may lack the
//! last writes. Two rules keep that from breaking the lock:
//!
//! - **Fencing tokens never go back on one server clock.** A token is `max(last + 1,
//!   TIME in µs)` of the Redis server, `last` from the key's holder record: if that
//!   record went back, was wiped or expired
//!   ([`fence_ttl`](RedisBackendBuilder::fence_ttl): by default one lease after the
//!   lock's TTL ran out), the clock still moved on. Tokens
//!   are monotonic across any restart or failover that loses writes *as long as the
//!   clock of the server that grants is not behind the clock of the one that granted
//!   before* (the same server after a restart, or a promoted replica whose clock is in
//!   sync) and no more than one grant per key happens per microsecond beyond the record
//!   (the record covers those). A record that expired did so a lease and its window
//!   after the key's last grant or renewal, so a grant after that is above every
//!   earlier token while the clock has not stepped back by more than that. A server
//!   clock stepped back by `d` can repeat tokens issued in the last `d`, unless the
//!   record survived. The restart guard adds a lease and a second to that margin
//!   after a restart: no grant comes sooner.
//! - **Restart guard.** A server that lost a key may grant it again while its holder,
//!   which cannot tell, still counts its lease as valid: for up to one lease after the
//!   restart. So while the server's `uptime_in_seconds` is below the lease plus one
//!   second (the uptime is counted in whole seconds), the acquire script grants nothing ([`restart_guard`](RedisBackendBuilder::restart_guard), on
//!   by default): the holder's lease reaches its local deadline (or its renewal finds
//!   the key gone) and the lost-lease signal is raised before any other instance gets
//!   the key. Acquisitions wait out the guard when their wait allows, or fail with
//!   [`LockError::Backend`] whose cause is a [`RetryLater`](crate::backend::RetryLater):
//!   the layer's 503 names the restart guard in its problem detail and sets
//!   `Retry-After` to the time left, and the backend logs one warning per guard
//!   period. In tests and local development, a short lease keeps the guard short; or
//!   turn it off (never in production). Every instance must use the same lease (the guard
//!   counts its own). The guard reads the time since the server's last save
//!   (`LASTSAVE`, set at startup and at every save, so never more than the uptime),
//!   and only when that is shorter than the guard the uptime from `INFO server`, both
//!   on the wall clock of the server; it does not cover a failover to a replica that has been up for
//!   long: lost writes there are only caught by the holder's renewal (at most lease/3
//!   later), and the fencing token.
//!
//! # Redis Cluster
//!
//! [`RedisBackend::cluster_builder`] takes a [`ClusterClient`] (built with RESP3, for the
//! subscription) and keeps every rule above: the keys of a lock share one hash tag,
//! so each script runs on the primary that owns the slot, and the restart guard reads
//! that primary's uptime. A silent cluster connection is replaced like a single one;
//! TCP settings are the cluster client's own. Releases use sharded pub/sub (Redis 7 or
//! newer): each lock has a shard channel named like its lock key, so in its slot, and
//! the release script `SPUBLISH`es there, which reaches only the nodes of that shard,
//! not the whole cluster. An instance subscribes (`SSUBSCRIBE`) to a lock's channel
//! from the moment its first waiter arrives to when its last leaves; until the
//! subscription is confirmed, a release could go unheard, so the confirmation wakes
//! the waiters to try once more (a contended wait costs one more attempt on a cluster).
//! When a slot moves to another primary the server drops its channels; the
//! subscription follows the slot to its new primary and wakes the waiters, and the
//! keys move with their TTLs, so the holder keeps its lease. When a primary fails, its
//! keys cannot be granted or renewed until a replica takes over (about the cluster's
//! node timeout plus an election); requests for them meanwhile get 503 within their
//! wait plus a command timeout, and a holder on that shard is told its lease is lost
//! at its deadline if no renewal gets through. With
//! [`wait_for_replicas`](RedisBackendBuilder::wait_for_replicas), the cluster
//! connection sends `WAIT` to every primary and takes the smallest count: every shard
//! needs that many replicas in sync.
//!
//! # Fairness between instances
//!
//! Within an instance, waiters of a key queue in arrival order on the layer's local lock
//! and only the first contends in Redis. Between instances, writers queue in Redis
//! (see *Hand-off* above): a release hands the key to the queued writer whose last
//! attempt came first, so a contender that has waited longer is not overtaken by one
//! that just arrived, and the releasing instance's next local waiter, which has not
//! queued yet, goes behind the others. The order is by each waiter's last attempt, not
//! its first: a waiter tries again only when its poll runs out (the holder's lease, at
//! most `poll_interval`) or a plain release is announced, so the queue keeps its order
//! while the key is handed on. Waiters that do not queue (a replay record looked for,
//! replicas to wait for, readers and permits) contend with `SET NX` as before, and
//! queued writers go first. For strict arrival order across instances, use the
//! PostgreSQL backend.
//!
//! # Shared locks and permits
//!
//! The backend gives every [`LockMode`]: shared holders
//! ([`DistributedLocks::lock_shared`](crate::DistributedLocks::lock_shared), the
//! layer's [`shared_methods`](crate::KeyedLockLayer::shared_methods)) and `n` permits
//! per key ([`permits`](crate::DistributedLocksBuilder::permits)).
//!
//! - **Holders.** Readers, and permit holders, are members of a sorted set per key
//!   (`:readers`, `:permits`): each its own random token, scored by its expiry in the
//!   server's milliseconds (`TIME`). A holder whose expiry has passed counts for
//!   nothing (the shared and permit acquire scripts prune it; a writer's skips it), so
//!   a crashed holder's place comes back one lease after its last grant or renewal;
//!   the set's own TTL is only ever extended, to the latest member's expiry. Renewal moves one's own score (only if still there and
//!   unexpired: else the lease is lost), release removes one's own token (or marks it
//!   given back, as for an exclusive lock), and both are one script each, by token.
//!   The scores are the server's wall clock (`TIME`), as Redis's own key expiry is: a
//!   server clock stepped forward ends them early, as it ends an exclusive lock's TTL.
//! - **Readers and writers.** A reader is granted when no writer holds `:lock` and no
//!   writer waits; a writer when `:lock` is free *and* no unexpired reader is left.
//!   A writer refused enters its token in the `:intent` sorted set (scored by the
//!   waiting mark's expiry: `poll_interval` + `command_timeout`, refreshed at every
//!   attempt) and leaves it when granted: while any writer waits, new readers of every
//!   instance are refused, so a stream of readers cannot starve writers. A writer
//!   whose wait ends without a grant, or whose acquisition is dropped, takes its entry
//!   out (its token's give-back, sent in the background); only if that fails does the
//!   entry keep new readers out until it expires, `poll_interval` + `command_timeout`
//!   at most. (A cancelled request's remote acquisition runs on, detached, to the end
//!   of its wait; a grant it gets is released at once.)
//! - **Permits.** A permit is granted while fewer than `n` unexpired holders are in
//!   `:permits`, no writer holds `:lock` and no writer waits; a writer is granted only
//!   when no unexpired permit holder is left either (one more `ZRANGEBYSCORE` in its
//!   script, sent only when no reader holds the key). So an instance configured with
//!   permits and one configured exclusive under the same name — in two processes, where
//!   the mismatch cannot be refused when built — exclude each other on a key, and a
//!   writer waiting for permit holders keeps new ones out as it keeps readers out.
//!   Each acquirer counts against its own `n`: instances configured with different
//!   `n` share the one set, and none enters while as many holders as its own `n` hold
//!   (the smaller `n` sees the key full sooner). Readers and permit holders do not
//!   exclude each other: both hold the key against writers only.
//! - **Wake-ups.** A reader's or permit holder's release publishes like a writer's
//!   (on the lock key's name) when a waiter marked the key, so waiters of every mode
//!   wake as for an exclusive lock; the poll is the backstop.
//! - **Fencing.** Writers and permit holders take a new token after the key's last one
//!   (`max(last + 1, server µs)`, kept in the holder record), so writers' tokens keep increasing
//!   across shared and exclusive grants. A reader takes none: its
//!   [`fencing_token`](crate::DistributedGuard::fencing_token) is the key's last
//!   token, the one of the last writer whose writes it reads (or of a later permit
//!   holder of the same key), or `None` if the key has none.
//! - **Cluster.** The sets share the key's hash tag, so every script runs on one slot.
//! # Who holds a key
//!
//! The grant (the acquire script, or a release handing the key on) records the holder: its token, the server's time
//! in ms, the fencing token and the instance id
//! ([`instance_id`](RedisBackendBuilder::instance_id)) in the `:holder` key under the
//! lock's hash tag. [`holder`](LockBackend::holder) reads the lock, its PTTL
//! (`lease_left`) and that record in one script, and uses the record only if it is
//! the current token's. The record lives as long as the lock and the
//! [`fence_ttl`](RedisBackendBuilder::fence_ttl) window after it (extended by every
//! renewal), and is not deleted by a release: it carries the key's last fencing token
//! for the next grant, which overwrites it.
//!
//! # Redis keys
//!
//! A layer named `name` locks request key `key` under
//!
//! ```text
//! {<prefix><name>:<key>}:lock     the token of the holder, with the lease as TTL
//! {<prefix><name>:<key>}:waiting  while another instance waits: its release publishes
//! {<prefix><name>:<key>}:readers  shared holders: tokens scored by expiry (ms)
//! {<prefix><name>:<key>}:permits  permit holders, the same way
//! {<prefix><name>:<key>}:intent   writers waiting: tokens scored by expiry (ms)
//! {<prefix><name>:<key>}:queue    writers waiting for a grant from a release: token →
//!                                 lease ms, fence TTL ms, instance id (same TTL as
//!                                 the intent)
//! {<prefix><name>:<key>}:holder   who was granted the lock last: token, grant time (ms,
//!                                 the server's clock), fencing token, instance id;
//!                                 written by the grant (the lock's TTL and the
//!                                 `fence_ttl` window, one lease by default)
//! {<prefix><name>:<key>}:lock:given-back:<token>
//!                                 a release found the key not held by <token>
//!                                 (for a minute, or a lease if longer)
//! ```
//!
//! Every one of them has a TTL, so Redis keeps records only for keys held or waited
//! for now, and for a window after: the holder record for at most
//! the rest of the lock's lease and the [`fence_ttl`](RedisBackendBuilder::fence_ttl)
//! window (two leases with the defaults) after a release or a crashed holder's
//! expiry; the waiting mark, intent and queue for `poll_interval` + `command_timeout`
//! after the last wait; readers and permits for a lease after the last holder. A
//! given-back mark is left only when a release finds the key not its own (a waiter
//! that stopped waiting, an attempt unanswered): it stays a minute, or a lease if
//! longer, so a late attempt of that token grants nothing. Keys that come from
//! clients (order ids, idempotency keys) therefore cost Redis nothing once their
//! requests are done, with no setting at all.
//!
//! These keys must live until their TTL. Under any `maxmemory-policy` but
//! `noeviction` (`volatile-*` ones pick keys with a TTL, as every lock key has;
//! `allkeys-*` ones pick any), Redis evicts keys when memory runs short, and a held
//! lock key evicted is granted to another instance while its holder still counts its
//! lease as valid: the holder learns it at its next renewal, up to lease/3 later. So
//! [`build`](RedisBackendBuilder::build) reads `maxmemory-policy` (`CONFIG GET`, or
//! `INFO memory` where `CONFIG` is renamed or not allowed; on a cluster, of every
//! primary) and refuses anything but `noeviction`, unless
//! [`allow_unsafe_eviction_policy`](RedisBackendBuilder::allow_unsafe_eviction_policy)
//! accepts the risk. A Redis used as a cache with eviction should not hold locks; give
//! the locks a Redis of their own.
//!
//! The policy can change after the build (`CONFIG SET`, a restart with another
//! configuration), so a running backend reads it again in the background: every
//! lease/3, at most every 5 s, and at once after its connection broke or was replaced
//! — one `CONFIG GET` per backend, not per lock. Once it reads an evicting policy,
//! it logs a warning, declares every lease it holds lost
//! ([`LostReason::NotOwner`](crate::backend::LostReason::NotOwner)), refuses new
//! acquisitions with [`LockError::Backend`] naming the policy (so the health check
//! reports it), until a read finds `noeviction` again. A key evicted between the
//! change and that read (a window of the re-read interval plus the read's own limit,
//! two command timeouts) can still be granted elsewhere before its holder is told.
//! With the opt-in, the change is only logged. A read that gets no answer changes
//! nothing, and is tried again within a second. What no setting can refuse: `FLUSHALL`, `FLUSHDB`,
//! or a `DEL` of a lock key by an operator or another application acts the same (the
//! holder is told at its next renewal, after the key may already have been granted
//! again); keep them from the lock server (`rename-command`, or ACLs).
//!
//! `name` and `key` are each written as-is when they are at most 64 bytes of ASCII
//! letters, digits and `- _ . @ + = / ~ ,`; anything else (`:`, `{`, `}`, `*`,
//! whitespace, other bytes, empty or longer text) is written as `#` followed by the
//! lowercase hex SHA-256 of its UTF-8 bytes. The plain alphabet has neither `#` nor
//! `:`, so a plain form never equals a hashed one, and the part between the braces splits
//! back into prefix, name and key at its last two colons: distinct (prefix, name, key)
//! triples never share a Redis key. The prefix (default `"keyed-lock:"`) gets a trailing
//! `:` if it has none and may not contain braces. The braces are a Redis Cluster hash
//! tag: the keys of a lock live in one slot, as a script needs.
//! [`RedisBackend::lock_key`] computes the name of the lock key.
//!
//! On one server the release channel is `<prefix>release`; its messages carry the lock
//! key, and for a hand-off the grant after it (one line each: token, fencing token,
//! lease ms). On a cluster each lock's shard channel is named like its lock key.
//!
//! The subscription uses RESP3 (Redis 6 or newer; on a cluster, Redis 7 for sharded
//! pub/sub), whatever protocol the commands use.

// One concern per file: `keys` names the Redis keys, `scripts` holds the Lua run on
// Redis, `cached` sends it by SHA1, `lease` acquires, renews and gives back leases, and `subscriber` turns release
// messages into wake-ups. This file has the public types and their configuration.
// `deployment` reads what the deployment check reports, and `replay` serves the Redis
// replay store. `cached`, `connection`, `eviction`, `keys` and `scripts` also serve
// `backend::redlock`.
pub(super) mod cached;
pub(super) mod connection;
pub(super) mod deployment;
pub(super) mod eviction;
pub(super) mod keys;
mod lease;
#[cfg(feature = "replay")]
mod replay;
pub(super) mod scripts;
mod subscriber;

#[cfg(feature = "replay")]
pub(crate) use self::connection::Connection;
#[cfg(feature = "replay")]
pub(crate) use self::scripts::last_token;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::{Client, ErrorKind, RedisError, Script};
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use self::connection::{with_tcp_settings, Commands, Target};
use self::keys::RedisKeys;
use self::scripts::{ACQUIRE, ACQUIRE_COUNTED, HOLDER};
use self::subscriber::{Releases, Subscriber};
use super::holder::from_unix_millis;
use super::settings::{self, Defaults, Settings};
use super::SetupError;
use super::{ttl, Acquisition, BoxFuture, Holder, LockBackend, LockMode};
use crate::error::LockError;
use crate::key::Key;

/// The default [`RedisBackendBuilder::lease`].
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default [`RedisBackendBuilder::command_timeout`].
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(1);
/// The default [`RedisBackendBuilder::poll_interval`].
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// The default [`RedisBackendBuilder::prefix`].
pub const DEFAULT_PREFIX: &str = "keyed-lock:";
/// The shortest lease accepted: renewal runs every lease/3.
pub const MIN_LEASE: Duration = Duration::from_millis(10);

/// A [`LockBackend`] on Redis: one connection for commands, one subscription for
/// release messages, shared by every clone. See the [module docs](self).
///
/// ```no_run
/// use tower_keyed_lock::backend::redis::RedisBackend;
/// use tower_keyed_lock::KeyedLockLayer;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
/// let layer = KeyedLockLayer::by_header("idempotency-key")
///     .name("deliveries")
///     .backend(backend);
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

/// Configures a [`RedisBackend`]; made by [`RedisBackend::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use tower_keyed_lock::backend::redis::RedisBackend;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let backend = RedisBackend::builder(redis::Client::open("redis://127.0.0.1/")?)
///     .lease(Duration::from_secs(10))
///     .max_hold(Some(Duration::from_secs(60)))
///     .prefix("shop:locks:")
///     .command_timeout(Duration::from_millis(500))
///     .build()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct RedisBackendBuilder {
    target: Target,
    config: Config,
}

#[derive(Clone, Debug)]
struct Config {
    settings: Settings,
    max_hold: Option<Duration>,
    /// How long the holder record (with the last fencing token) outlives the lock's TTL; `None`:
    /// for ever (the opt-out).
    record_window: Option<RecordWindow>,
    restart_guard: bool,
    replicas: Option<Replicas>,
    allow_eviction: bool,
}

/// Redis's defaults and limits.
static DEFAULTS: Defaults = settings::defaults!("Redis", key_prefix);

/// A prefix as Redis keys start with it: ending with `:`, and without braces, which
/// would break the Redis Cluster hash tag.
pub(super) fn key_prefix(prefix: &str) -> Result<String, String> {
    if prefix.contains(['{', '}']) {
        return Err("contains a brace, which would break the Redis Cluster hash tag".into());
    }
    Ok(settings::ending_with(prefix, ':'))
}

/// How many replicas must acknowledge a grant or renewal, and for how long to wait.
#[derive(Clone, Copy, Debug)]
struct Replicas {
    count: u32,
    timeout: Duration,
}

impl Replicas {
    /// `WAIT`: how many replicas acknowledged every write sent on `connection` so far.
    async fn wait(
        self,
        connection: &mut impl redis::aio::ConnectionLike,
    ) -> Result<u32, RedisError> {
        let timeout = u64::try_from(self.timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        redis::cmd("WAIT")
            .arg(self.count)
            .arg(timeout)
            .query_async(connection)
            .await
    }
}

impl Config {
    /// The TTL an acquisition asks for: the lease, shortened to `max_hold`.
    fn first_ttl(&self) -> Duration {
        self.max_hold
            .map_or(self.settings.lease, |max| max.min(self.settings.lease))
    }

    /// The window the holder record outlives the lock by: at least
    /// one lease (tokens then stay above every earlier one unless the server clock
    /// steps back by more than it).
    fn record_window(&self) -> Option<Duration> {
        self.record_window.map(|window| match window {
            RecordWindow::OneLease => self.settings.lease,
            RecordWindow::After(window) => window.max(self.settings.lease),
        })
    }

    /// The TTL in ms of the holder record written with a grant
    /// or renewal of `held`: that and the window; 0 for no TTL.
    fn record_ttl_ms(&self, held: Duration) -> u64 {
        self.record_window()
            .map_or(0, |window| lease::millis(held + window))
    }
}

/// How long a key's holder record outlives its lock.
#[derive(Clone, Copy, Debug)]
enum RecordWindow {
    /// One lease, whatever the lease is set to: the default.
    OneLease,
    /// As set with [`RedisBackendBuilder::fence_ttl`] (at least one lease).
    After(Duration),
}

struct Inner {
    commands: Arc<Commands>,
    /// What may evict lock keys, re-read while the backend runs.
    eviction: eviction::EvictionState,
    config: Config,
    /// The shared release channel; empty on a cluster (a shard channel per lock).
    channel: String,
    releases: Arc<Releases>,
    subscribed: watch::Receiver<bool>,
    /// Until when the restart guard's warning covers: it is logged once per period.
    guard_warned_until: Mutex<Option<Instant>>,
    /// Leases held for less than a renewal period, with no task of their own.
    schedule: ttl::Schedule<Inner>,
    /// Dropped with the last user of the backend; that ends the subscription task.
    _stop: oneshot::Sender<()>,
}

impl RedisBackend {
    /// Starts configuring a backend that talks to Redis through `client`.
    pub fn builder(client: Client) -> RedisBackendBuilder {
        Self::builder_for(Target::Single(client))
    }

    /// Starts configuring a backend on a Redis Cluster, with the same settings and
    /// behaviour as on a single server (see [Redis Cluster](self#redis-cluster)).
    /// `client` must speak RESP3, for the release subscription.
    ///
    /// ```no_run
    /// use tower_keyed_lock::backend::redis::RedisBackend;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let nodes = ["redis://10.0.0.1:6379/", "redis://10.0.0.2:6379/"];
    /// let client = redis::cluster::ClusterClientBuilder::new(nodes)
    ///     .use_protocol(redis::ProtocolVersion::RESP3)
    ///     .build()?;
    /// let backend = RedisBackend::cluster_builder(client).build().await?;
    /// # let _ = backend;
    /// # Ok(())
    /// # }
    /// ```
    pub fn cluster_builder(client: ClusterClient) -> RedisBackendBuilder {
        Self::builder_for(Target::Cluster(Box::new(client)))
    }

    fn builder_for(target: Target) -> RedisBackendBuilder {
        RedisBackendBuilder {
            target,
            config: Config {
                settings: Settings::new(&DEFAULTS),
                max_hold: None,
                record_window: Some(RecordWindow::OneLease),
                restart_guard: true,
                replicas: None,
                allow_eviction: false,
            },
        }
    }

    /// A backend with the default settings on the Redis server at `url`
    /// (such as `redis://127.0.0.1/`); see [`RedisBackendBuilder::build`].
    ///
    /// ```no_run
    /// use tower_keyed_lock::backend::redis::RedisBackend;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
    /// # let _ = backend;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        let client = Client::open(url)
            .map_err(|error| SetupError::Invalid(format!("the Redis URL: {error}")))?;
        Self::builder(client).build().await
    }

    /// The Redis key that holds the lock of `key` for the layer called `name` (see
    /// [Redis keys](self#redis-keys)); its holder record and waiting mark have the
    /// same name with `:holder` and `:waiting` instead of `:lock`.
    ///
    /// ```no_run
    /// # use tower_keyed_lock::backend::redis::RedisBackend;
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// # let backend = RedisBackend::connect("redis://127.0.0.1/").await?;
    /// assert_eq!(backend.lock_key("orders", "42"), "{keyed-lock:orders:42}:lock");
    /// assert!(backend.lock_key("orders", "a:b").starts_with("{keyed-lock:orders:#"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn lock_key(&self, name: &str, key: &str) -> String {
        RedisKeys::new(&self.inner.config.settings.prefix, name, key)
            .lock
            .to_string()
    }

    /// Whether the release subscription is up now. While it is down, waiters poll every
    /// 50 ms at most instead of waiting for release messages.
    pub fn is_subscribed(&self) -> bool {
        *self.inner.subscribed.borrow()
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("config", &self.inner.config)
            .field("subscribed", &self.is_subscribed())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RedisBackendBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackendBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedisBackendBuilder {
    settings::lease_settings!(config.settings; instance_id lease renewal drift_margin command_timeout poll_interval prefix);

    /// The longest a lease lasts however often it is renewed (default `None`: no
    /// limit): the key expires in Redis, and the lease is lost, `max_hold` after the
    /// acquisition was sent. A stuck handler cannot hold a key forever.
    pub fn max_hold(mut self, max_hold: Option<Duration>) -> Self {
        self.config.max_hold = max_hold;
        self
    }

    /// How long a key's holder record (with its last fencing token) outlives its lock, after the
    /// lock's last grant or renewal ran out (default: one lease, whatever the lease is).
    /// A window shorter than the lease is raised to the lease. So after a release (or a
    /// crashed holder's expiry) Redis keeps nothing of a key for longer than the
    /// lease's rest plus this window: with the default, two leases at most; safe for
    /// keys that come from clients (idempotency keys, order ids), with no setting at
    /// all. See [Redis keys](self#redis-keys).
    ///
    /// Fencing tokens still never go back for a key: a token is at least the Redis
    /// server clock in microseconds, so a grant after the record expired (a window or
    /// more after the last one) is above every token given before, as long as that
    /// clock does not step back by more than the window (see
    /// [Restarts and lost writes](self#restarts-and-lost-writes)).
    ///
    /// `None` keeps it for ever (one small key per key ever locked, without bound):
    /// only for a key space that is small and fixed.
    pub fn fence_ttl(mut self, ttl: Option<Duration>) -> Self {
        self.config.record_window = ttl.map(RecordWindow::After);
        self
    }

    /// Whether a Redis server up for less than a lease (plus one second) grants
    /// nothing (default on).
    /// A server restarted empty, or from a snapshot older than some grant, has lost
    /// keys that instances may still hold for up to a lease; with the guard on, no
    /// other instance is granted such a key before its holder's lease has run out
    /// (and the holder has been told). The cost: for a lease and a second after Redis
    /// starts, acquisitions wait, or fail with [`LockError::Backend`] when their wait
    /// is shorter (503 with the reason and `Retry-After`, or
    /// [`fail_open`](crate::KeyedLockLayer::fail_open)). Every instance sharing Redis
    /// should use the same lease. See
    /// [Restarts and lost writes](self#restarts-and-lost-writes).
    ///
    /// Off is for tests and local development against a Redis that just started
    /// (`docker compose up`, CI), where a lock lost in a restart costs nothing; a short
    /// [`lease`](Self::lease) is the other way to keep the wait short there. **Never
    /// turn it off in production**: a restarted Redis could then grant a lock that an
    /// instance still holds.
    pub fn restart_guard(mut self, on: bool) -> Self {
        self.config.restart_guard = on;
        self
    }

    /// Waits after every grant and renewal until `replicas` replicas acknowledged it
    /// (Redis `WAIT`, as Redisson does), at most `timeout` (default: no waiting). A
    /// grant acknowledged by fewer is given back and the acquisition fails with
    /// [`LockError::Backend`]; a renewal acknowledged by fewer does not extend the
    /// lease's validity, so a lease whose renewals cannot be replicated is declared
    /// lost at its deadline.
    ///
    /// What it buys: a failover that promotes an acknowledging replica keeps the key,
    /// with its TTL, so no other instance is granted it while the holder counts its
    /// lease as valid. Ask for **every** replica: with fewer, a failover can promote a
    /// replica that missed a renewal the others acknowledged (Sentinel promotes one
    /// while the old primary, not yet demoted, renews with the other's
    /// acknowledgement), and the promoted one expires the key while the holder still
    /// counts its lease as valid — seen in every run of that test with one of two.
    ///
    /// What it costs: one more round trip to the slowest acknowledging replica per
    /// grant and renewal; while `WAIT` blocks, the backend's other commands (one
    /// connection) queue behind it; and no grant succeeds while a replica is missing
    /// (after a failover, until the old primary rejoins as a replica). What it does
    /// not guarantee: `WAIT` is not consensus — a replica restarted without
    /// persistence forgets what it acknowledged, a replica added later has not
    /// acknowledged anything, and a write whose `WAIT` fell short is not undone on
    /// the replicas that got it. `timeout` counts within the
    /// [`command_timeout`](Self::command_timeout), which should exceed it.
    ///
    /// # Panics
    /// If `replicas` is 0.
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        assert!(replicas > 0, "wait_for_replicas needs at least one replica");
        self.config.replicas = Some(Replicas {
            count: replicas,
            timeout,
        });
        self
    }

    /// Whether to build on a Redis that may evict keys — **unsafe** (default off:
    /// refused). Under any `maxmemory-policy` but `noeviction` (every `volatile-*` and
    /// `allkeys-*` policy), Redis drops keys under memory pressure, a held lock key
    /// among them; another instance is then granted the key while its holder still
    /// counts its lease as valid, and learns otherwise only at its next renewal (up to
    /// lease/3 later). [`build`](Self::build) reads the policy (of every primary of a
    /// cluster) and refuses anything but `noeviction`, and the running backend reads
    /// it again (every lease/3, at most 5 s): a policy changed to an evicting one then
    /// ends every lease held and refuses grants until `noeviction` is back. With this
    /// on, both only log a warning. Turn it on only if the lock keys' overlap is acceptable, or if memory
    /// can never run short. See [Redis keys](self#redis-keys).
    pub fn allow_unsafe_eviction_policy(mut self, allow: bool) -> Self {
        self.config.allow_eviction = allow;
        self
    }

    /// Connects: checks that Redis answers and that it cannot evict lock keys (see
    /// [`allow_unsafe_eviction_policy`](Self::allow_unsafe_eviction_policy)) and
    /// subscribes to the release channel, each within the command timeout, then
    /// starts the subscription task (on the current tokio runtime; it ends with the
    /// last clone of the backend and its leases). Fails if Redis cannot be reached,
    /// its `maxmemory-policy` is not `noeviction` (or cannot be read), or the
    /// subscription fails (it needs RESP3: Redis 6 or newer).
    pub async fn build(self) -> Result<RedisBackend, SetupError> {
        let Self { target, config } = self;
        let config = Config {
            settings: config.settings.check()?,
            ..config
        };
        let limit = config.settings.command_timeout;
        let engine = match &target {
            Target::Single(_) => DEFAULTS.engine,
            Target::Cluster(_) => "Redis Cluster",
        };
        let failed = |cause: RedisError| SetupError::failed(engine, target.address(), cause);
        // The kernel's own backstop for a dead path; replacing a silent connection
        // after a few command timeouts is the fast one. A cluster client keeps the
        // TCP settings it was built with.
        let target = match &target {
            Target::Single(client) => Target::Single(
                with_tcp_settings(client, (limit * 10).max(Duration::from_secs(5)))
                    .map_err(failed)?,
            ),
            cluster @ Target::Cluster(_) => cluster.clone(),
        };
        let commands = Commands::new(target.clone(), limit).map_err(failed)?;
        let ping = commands.run(Instant::now() + limit, false, |mut connection| async move {
            redis::cmd("PING").query_async::<()>(&mut connection).await
        });
        ping.await.map_err(|failure| match failure {
            connection::Failure::Redis(error) => failed(error),
            connection::Failure::TimedOut => SetupError::no_answer(engine, target.address(), limit),
        })?;
        // The scripts of every lock, cached before the first one: its acquire and
        // release are then one round trip each. Best effort: a script missing later
        // (NOSCRIPT) is sent with its text.
        let load = commands.run(Instant::now() + limit, false, |mut connection| async move {
            for text in [
                ACQUIRE,
                ACQUIRE_COUNTED,
                scripts::RELEASE,
                scripts::RELEASE_COUNTED,
            ] {
                redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(text)
                    .query_async::<()>(&mut connection)
                    .await?;
            }
            Ok(())
        });
        if let Err(failure) = load.await {
            tracing::debug!(?failure, "loading the redis lock scripts failed");
        }
        // CONFIG GET, or INFO where CONFIG is not allowed: two command timeouts at most.
        let policies = commands
            .run(Instant::now() + limit * 2, false, eviction::policies)
            .await
            .map_err(|failure| match failure {
                connection::Failure::Redis(error) => error,
                connection::Failure::TimedOut => timed_out("reading maxmemory-policy"),
            });
        eviction::check(policies, config.allow_eviction).map_err(SetupError::Unsafe)?;
        let commands = Arc::new(commands);
        let eviction = eviction::watch(
            &commands,
            eviction::recheck_interval(config.settings.lease),
            config.allow_eviction,
        );

        let shared_channel = format!("{}release", config.settings.prefix);
        let (releases, changes, channel) = match &target {
            Target::Single(_) => {
                let (releases, changes) = Releases::shared_channel();
                (releases, changes, shared_channel.clone())
            }
            // The release script publishes on the lock's own shard channel.
            Target::Cluster(_) => {
                let (releases, changes) = Releases::shard_channels();
                (releases, changes, String::new())
            }
        };
        let subscriber = Subscriber::new(&target, shared_channel, limit).map_err(failed)?;
        let first = subscriber.subscribe(&releases).await.map_err(failed)?;
        let (subscribed_tx, subscribed) = watch::channel(true);
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(subscriber.run(first, releases.clone(), changes, subscribed_tx, stopped));

        let (eviction_state, allow_eviction) = (eviction.clone(), config.allow_eviction);
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                commands,
                eviction,
                config,
                channel,
                releases,
                subscribed,
                guard_warned_until: Mutex::new(None),
                schedule: ttl::Schedule::new(lease::gone_for_all(&eviction_state, allow_eviction)),
                _stop: stop,
            }),
        })
    }
}

fn timed_out(what: &'static str) -> RedisError {
    RedisError::from((ErrorKind::Io, "timed out", what.to_owned()))
}

impl LockBackend for RedisBackend {
    super::engine_head::engine_head!("redis", findings = deployment::findings);

    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        self.acquire_mode(name, key, LockMode::Exclusive, wait)
    }

    fn acquire_mode(&self, name: &str, key: &Key, mode: LockMode, wait: Duration) -> Acquisition {
        let keys =
            RedisKeys::new(&self.inner.config.settings.prefix, name, key.as_str()).with_mode(mode);
        let acquire = self.inner.clone().acquire(Arc::new(keys), wait);
        Box::pin(async move { acquire.await?.into_lease() })
    }

    /// Looks for a record of the Redis replay store made on this backend (not a clone
    /// of another one's), in the acquire script itself.
    #[cfg(feature = "replay")]
    fn acquire_unless_recorded(
        &self,
        name: &str,
        key: &Key,
        wait: Duration,
        record: &super::RecordLookup,
    ) -> Option<BoxFuture<Result<super::Acquired, LockError>>> {
        #[allow(irrefutable_let_patterns)]
        let super::Place::Redis {
            engine,
            key: record,
        } = &record.place
        else {
            return None;
        };
        if *engine != self.engine_id() {
            return None;
        }
        let keys = RedisKeys::new(&self.inner.config.settings.prefix, name, key.as_str())
            .looking_for(record.clone());
        Some(Box::pin(self.inner.clone().acquire(Arc::new(keys), wait)))
    }

    /// Every mode: see [Shared locks and permits](self#shared-locks-and-permits).
    fn supports(&self, _mode: LockMode) -> bool {
        true
    }
    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let keys = RedisKeys::new(&self.inner.config.settings.prefix, name, key.as_str());
        let inner = self.inner.clone();
        Box::pin(async move {
            let script = Script::new(HOLDER);
            let mut invocation = script.key(&*keys.lock);
            invocation.key(keys.holder());
            let limit = Instant::now() + inner.config.settings.command_timeout;
            let answer: Vec<redis::Value> = inner
                .commands
                .run(limit, true, |mut connection| async move {
                    invocation.invoke_async(&mut connection).await
                })
                .await
                .map_err(|failure| match failure {
                    connection::Failure::Redis(error) => LockError::Backend(Box::new(error)),
                    connection::Failure::TimedOut => {
                        LockError::Backend(Box::new(timed_out("reading the holder of a key")))
                    }
                })?;
            Ok(parse_holder(answer))
        })
    }
}

/// The answer of the `HOLDER` script as a [`Holder`].
fn parse_holder(answer: Vec<redis::Value>) -> Option<Holder> {
    // The token comes first (Redlock compares it across masters); one server's lock
    // has one holder.
    let mut answer = answer.into_iter().skip(1);
    let pttl: i64 = redis::from_redis_value(answer.next()?).unwrap_or(-1);
    let mut holder = Holder::new();
    if let Ok(left) = u64::try_from(pttl) {
        holder = holder.with_lease_left(Duration::from_millis(left));
    }
    let record: Option<String> = answer.next().and_then(|v| redis::from_redis_value(v).ok());
    if let Some(record) = record {
        let mut fields = record.splitn(3, '\n');
        if let Some(millis) = fields.next().and_then(|m| m.parse().ok()) {
            holder = holder.with_since(from_unix_millis(millis));
        }
        if let Some(token) = fields.next().and_then(|t| t.parse().ok()) {
            holder = holder.with_fencing_token(token);
        }
        if let Some(instance) = fields.next() {
            holder = holder.with_instance(instance);
        }
    }
    Some(holder)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_gets_a_colon_and_refuses_braces() {
        let builder = RedisBackend::builder(Client::open("redis://127.0.0.1/").unwrap());
        let prefix = |prefix| {
            let settings = builder.clone().prefix(prefix).config.settings;
            settings.check().map(|settings| settings.prefix)
        };
        assert_eq!(prefix("app").unwrap(), "app:");
        assert_eq!(prefix("app:").unwrap(), "app:");
        assert_eq!(prefix("").unwrap(), "");
        assert!(matches!(prefix("a{b}"), Err(SetupError::Invalid(_))));
    }
}
