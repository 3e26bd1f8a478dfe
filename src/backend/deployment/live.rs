//! The live part of the deployment check: a few locks taken and given back on the
//! engine, under a scratch lock name of their own, through the backend the locks use.

use std::time::{Duration, SystemTime};

use tokio::time::{sleep, Instant};

use super::{Finding, Millis};
use crate::backend::{Lease, LockBackend};
use crate::key::Key;
use crate::LockError;

/// The longest any one acquisition of the run waits. Every step of the run is bounded
/// by it plus the backend's own command timeout.
pub(crate) const LIVE_WAIT: Duration = Duration::from_secs(5);

/// Uncontended locks and releases timed for the round trip (their median is reported);
/// their fencing tokens must go up.
const ROUNDS: usize = 5;

/// Hand-offs timed from a release to the grant of the waiter behind it.
const HAND_OFFS: usize = 3;

/// Runs the live checks under a fresh scratch lock name; returns their findings, in
/// the order run. A step that cannot run (the engine grants nothing) ends the run with
/// a failed finding.
pub(crate) async fn live_run(backend: &dyn LockBackend) -> Vec<Finding> {
    let name = scratch_name();
    let mut findings = Vec::new();
    let keys =
        ["round_trip", "exclusion"].map(|key| Key::new(key, key.len()).expect("a valid key"));
    let [round_trip_key, exclusion_key] = &keys;
    let Some(tokens) = round_trips(backend, &name, round_trip_key, &mut findings).await else {
        return findings;
    };
    findings.push(fencing(backend, &tokens));
    findings.extend(exclusion_and_hand_off(backend, &name, exclusion_key).await);
    findings.push(left_behind(backend, &name, &keys).await);
    findings
}

/// A lock name no layer or job uses: this process and this instant.
fn scratch_name() -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("keyed_lock_check_{:x}_{nanos:x}", std::process::id())
}

/// Takes and gives back `key` [`ROUNDS`] times; reports the median times as
/// `round_trip`, and returns each grant's fencing token. `None` (with a failed
/// finding) when the engine did not grant the free key.
async fn round_trips(
    backend: &dyn LockBackend,
    name: &str,
    key: &Key,
    findings: &mut Vec<Finding>,
) -> Option<Vec<Option<u64>>> {
    let mut tokens = Vec::with_capacity(ROUNDS);
    let (mut locks, mut releases) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let started = Instant::now();
        let lease = match backend.acquire(name, key, LIVE_WAIT).await {
            Ok(lease) => lease,
            Err(error) => {
                findings.push(Finding::fail(
                    "round_trip",
                    format!("a free key was not granted: {error}"),
                    "the locks need the engine to grant a free key",
                    "check the address, the credentials and that this instance may write; the error says which",
                ));
                return None;
            }
        };
        let granted = Instant::now();
        tokens.push(lease.fencing_token());
        lease.release().await;
        locks.push(granted - started);
        releases.push(granted.elapsed());
    }
    findings.push(Finding::pass(
        "round_trip",
        format!(
            "a free key granted in {} and given back in {} (medians of {ROUNDS})",
            Millis(median(&mut locks)),
            Millis(median(&mut releases))
        ),
        "every request through a layer with this backend pays this once on top of its handler",
    ));
    Some(tokens)
}

/// Whether the grants' fencing tokens went up, grant after grant.
fn fencing(backend: &dyn LockBackend, tokens: &[Option<u64>]) -> Finding {
    const WHY: &str = "a storage write guarded by the token refuses a holder whose lease \
        was lost and whose key went to another: without tokens that only go up, a paused \
        holder can still overwrite its successor";
    if !backend.issues_fencing_tokens() {
        let reason = backend
            .no_fencing_tokens_reason()
            .unwrap_or("not issued by this backend");
        return Finding::warn(
            "fencing_tokens",
            format!("no fencing tokens: {reason}"),
            WHY,
            "turn them on where the backend has a setting for it (PostgreSQL, MySQL: fencing(true)); else guard writes another way (a conditional write on the data itself)",
        );
    }
    let shown = tokens
        .iter()
        .map(|token| token.map_or("none".to_owned(), |token| token.to_string()))
        .collect::<Vec<_>>()
        .join(", ");
    let rising = tokens.windows(2).all(|pair| match pair {
        [Some(before), Some(after)] => after > before,
        _ => false,
    });
    match rising && tokens.iter().all(Option::is_some) {
        true => Finding::pass("fencing_tokens", format!("tokens {shown}, each above the last"), WHY),
        false => Finding::fail(
            "fencing_tokens",
            format!("tokens {shown}: not each above the last"),
            WHY,
            "a token that goes back means the engine lost its state (a restart without persistence, a failover to a stale copy): make the engine's storage durable",
        ),
    }
}

/// Holds a key and asks for it again at once (`exclusion`: it must be refused), then
/// times the hand-offs of a held key to a waiter ([`HAND_OFFS`], median).
async fn exclusion_and_hand_off(backend: &dyn LockBackend, name: &str, key: &Key) -> Vec<Finding> {
    const EXCLUSION: &str = "exclusion";
    const WHY: &str = "one holder per key is the lock's promise";
    let mut holder = match backend.acquire(name, key, LIVE_WAIT).await {
        Ok(lease) => lease,
        Err(error) => {
            return vec![Finding::fail(
                EXCLUSION,
                format!("a free key was not granted: {error}"),
                WHY,
                "see the error",
            )]
        }
    };
    let exclusion = match backend.acquire(name, key, Duration::ZERO).await {
        Err(LockError::Timeout | LockError::Busy) => Finding::pass(
            EXCLUSION,
            "a second acquisition of a held key was refused",
            WHY,
        ),
        Ok(second) => {
            second.release().await;
            holder.release().await;
            return vec![Finding::fail(
                EXCLUSION,
                "a second acquisition of a held key was granted: two holders at once",
                WHY,
                "the engine does not keep the lock between sessions: check for a proxy or pooler that shares one session, or a replica answering writes",
            )];
        }
        Err(error) => {
            holder.release().await;
            return vec![Finding::fail(
                EXCLUSION,
                format!("a second acquisition of a held key failed: {error}"),
                WHY,
                "see the error",
            )];
        }
    };
    let mut hand_offs = Vec::with_capacity(HAND_OFFS);
    for _ in 0..HAND_OFFS {
        match hand_off(backend, name, key, holder).await {
            Ok((took, next)) => {
                hand_offs.push(took);
                holder = next;
            }
            Err(error) => {
                let failed = Finding::fail(
                    "hand_off",
                    format!("a waiter was not granted the key its holder released: {error}"),
                    "a released key must reach its waiter within the wait",
                    "see the error",
                );
                return vec![exclusion, failed];
            }
        }
    }
    holder.release().await;
    let hand_off = Finding::pass(
        "hand_off",
        format!(
            "a waiter granted {} after its holder's release began (median of {HAND_OFFS})",
            Millis(median(&mut hand_offs))
        ),
        "a hot key passes from request to request at this pace, at best",
    );
    vec![exclusion, hand_off]
}

/// A waiter asks for `key` while `holder` holds it; once the waiter has had time to
/// wait, the holder gives it back. Returns the time from the release to the waiter's
/// grant, and the waiter's lease.
async fn hand_off(
    backend: &dyn LockBackend,
    name: &str,
    key: &Key,
    holder: Lease,
) -> Result<(Duration, Lease), LockError> {
    let waiter = backend.acquire(name, key, LIVE_WAIT);
    let release = async {
        // Long enough for the waiter's first attempt to reach the engine and find the
        // key held: the measure is of a hand-off, not of a first try.
        sleep(Duration::from_millis(50)).await;
        let released_at = Instant::now();
        holder.release().await;
        released_at
    };
    let (granted, released_at) = tokio::join!(
        async {
            let lease = waiter.await;
            (lease, Instant::now())
        },
        release
    );
    let (lease, granted_at) = granted;
    Ok((granted_at.saturating_duration_since(released_at), lease?))
}

/// Whether any scratch key still has a holder once the run gave every lease back.
async fn left_behind(backend: &dyn LockBackend, name: &str, keys: &[Key]) -> Finding {
    const CHECK: &str = "left_behind";
    const WHY: &str = "a released key must be free for the next holder at once";
    let mut held = Vec::new();
    for key in keys {
        match backend.holder(name, key).await {
            Ok(None) => {}
            Ok(Some(holder)) => held.push(format!("{} ({holder})", key.as_str())),
            Err(LockError::Unsupported(_)) => {
                return Finding::pass(
                    CHECK,
                    "not checked: this backend cannot say who holds a key",
                    WHY,
                );
            }
            Err(error) => {
                return Finding::warn(CHECK, format!("not checked: {error}"), WHY, "see the error")
            }
        }
    }
    match held.is_empty() {
        true => Finding::pass(
            CHECK,
            format!("no scratch key held under `{name}` afterwards"),
            WHY,
        ),
        false => Finding::fail(
            CHECK,
            format!("still held after their release: {}", held.join(", ")),
            WHY,
            "a release that does not free the key is an engine fault: report it with this output",
        ),
    }
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort_unstable();
    times.get(times.len() / 2).copied().unwrap_or_default()
}
