//! The fault checks: an instance whose path to the engine goes through a [`FaultProxy`]
//! that makes it silent, slow, or reset, while another instance reaches the engine
//! directly. Each check panics with the guarantee that broke.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Waker};
use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::mutual::eventually_free;
use super::{
    after_a_stall, instance, starting_over_past_a_stall, taken_over, within_for, Deployment,
    Lateness, PATIENCE,
};
use crate::backend::{LostReason, HEALTH_PROBE_WAIT};
use crate::{DistributedLocks, LockBackend, LockError};

pub use super::proxy::FaultProxy;

/// Slack for a loaded machine on bounds the backends document (a wait plus one command
/// timeout): far below what a hang on a silent TCP path costs (minutes).
const SLACK: Duration = Duration::from_secs(1);

/// A [`Deployment`] whose instances can reach the engine through a [`FaultProxy`].
pub trait Proxied: Deployment {
    /// Where the engine listens.
    fn upstream(&self) -> SocketAddr;

    /// A backend for one more instance whose connections go to `host_port` (a proxy's
    /// [`host_port`](FaultProxy::host_port)) instead of [`upstream`](Self::upstream).
    fn backend_via(
        &self,
        host_port: &str,
    ) -> impl std::future::Future<Output = Arc<dyn LockBackend>> + Send;

    /// The longest one request may take before the backend counts it as unanswered
    /// (its builder's `command_timeout`).
    fn command_timeout(&self) -> Duration;

    /// How long after another instance is granted a key its holder may hear that its
    /// lease is lost when the holder's connections are reset: zero for a TTL lease (the
    /// record outlives the connection); for a session lock, which the server frees the
    /// moment the connection dies, the bound the backend documents.
    fn reset_notice(&self) -> Duration {
        Duration::ZERO
    }
}

/// An instance of the application whose backend goes through `proxy`.
async fn instance_via<P: Proxied>(
    deployment: &P,
    proxy: &FaultProxy,
    check: &'static str,
) -> DistributedLocks {
    DistributedLocks::builder(check)
        .shared_backend(deployment.backend_via(&proxy.host_port()).await)
        .build()
}

/// A check's two instances: the first behind a new fault proxy, the other direct.
async fn proxied_and_direct<P: Proxied>(
    deployment: &P,
    check: &'static str,
) -> (FaultProxy, DistributedLocks, DistributedLocks) {
    let proxy = FaultProxy::start(deployment.upstream()).await;
    let behind = instance_via(deployment, &proxy, check).await;
    (proxy, behind, instance(deployment, check).await)
}

/// The holder's path goes silent (no reset: a partition, a dead NAT entry) while
/// another instance waits for its key: the holder is told its lease is lost before that
/// instance is granted.
pub async fn a_cut_off_holder_is_told_before_another_instance_is_granted<P: Proxied>(
    deployment: &P,
) {
    const CHECK: &str = "a_cut_off_holder_is_told_before_another_instance_is_granted";
    let (proxy, a, b) = proxied_and_direct(deployment, CHECK).await;
    let guard = within_for("a takes the key", PATIENCE, a.lock("cut"))
        .await
        .unwrap();
    let signal = guard.lease().expect("a remote lease").clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    proxy.blackhole();
    let cut = Instant::now();
    let taken = taken_over(&b, "cut", "b takes the cut-off holder's key").await;
    let granted = Instant::now();
    let told = within_for("the holder is told", PATIENCE, told)
        .await
        .unwrap();
    assert!(
        told <= granted,
        "conformance: unsignalled overlap: b was granted {:?} before the cut-off holder was told",
        told - granted
    );
    assert!(guard.is_lost());
    tracing::info!(
        told = ?(told - cut),
        granted = ?(granted - cut),
        margin = ?(granted - told),
        "cut off: the holder was told, then another instance granted"
    );
    taken.release().await;
}

/// Through a silent path, an acquisition ends (with an error or a timeout) within its
/// wait plus about one command timeout, never hanging; once the path heals, the backend
/// serves again without a restart.
pub async fn no_acquisition_outlives_its_wait_on_a_silent_path<P: Proxied>(deployment: &P) {
    const CHECK: &str = "no_acquisition_outlives_its_wait_on_a_silent_path";
    let proxy = FaultProxy::start(deployment.upstream()).await;
    let a = instance_via(deployment, &proxy, CHECK).await;
    // A connection in use before the fault.
    a.lock("warm").await.unwrap().release().await;
    let lateness = Lateness::watch();
    proxy.blackhole();
    let wait = Duration::from_millis(300);
    for key in ["silent-1", "silent-2", "silent-3"] {
        let started = Instant::now();
        let outcome = within_for(
            "an acquisition on a silent path",
            PATIENCE,
            a.lock_timeout(key, wait),
        )
        .await;
        let took = started.elapsed();
        assert!(
            outcome.is_err(),
            "conformance: granted through a silent path: {outcome:?}"
        );
        let bound = lateness.allowing(wait + 2 * deployment.command_timeout() + SLACK);
        assert!(
            took < bound,
            "conformance: an acquisition took {took:?} on a silent path (bound {bound:?})"
        );
    }
    proxy.heal();
    let healed = until_granted(&a, "after", "the backend serves again after the heal").await;
    healed.release().await;
}

/// A path slower than usual but within the command timeout (a quarter of it each way)
/// keeps the lease: renewals or liveness checks get through, for twice the loss bound.
/// (A machine so loaded that they went unanswered all the same, signalled to the holder,
/// starts the check over on another key, three attempts at most.)
pub async fn a_slow_path_keeps_the_lease<P: Proxied>(deployment: &P) {
    const CHECK: &str = "a_slow_path_keeps_the_lease";
    let (proxy, a, b) = proxied_and_direct(deployment, CHECK).await;
    let (proxy, a, b) = (&proxy, &a, &b);
    starting_over_past_a_stall(CHECK, |key| async move {
        let guard = a.lock(&key).await.unwrap();
        let granted = Instant::now();
        proxy.delay(deployment.command_timeout() / 4);
        sleep(2 * deployment.loss_bound()).await;
        proxy.delay(Duration::ZERO);
        match guard.lost_reason() {
            None => {}
            Some(reason) if after_a_stall(reason) => return Some(granted.elapsed()),
            Some(reason) => {
                panic!("conformance: a slow path within the command timeout lost the lease ({reason:?})")
            }
        }
        assert!(
            matches!(b.try_lock(&key).await, Err(LockError::Busy)),
            "conformance: another instance took the key of a holder on a slow path"
        );
        guard.release().await;
        None
    })
    .await;
}

/// The health check through a silent path says unhealthy, with the engine's error,
/// within about one command timeout (never hanging), and healthy again once the path
/// heals.
pub async fn the_health_check_fails_on_a_silent_path_and_recovers<P: Proxied>(deployment: &P) {
    let proxy = FaultProxy::start(deployment.upstream()).await;
    let backend = deployment.backend_via(&proxy.host_port()).await;
    // Healthy before the fault (on a loaded machine a first check can outlast the
    // command timeout).
    until_healthy(&*backend, "before the fault", PATIENCE).await;
    let lateness = Lateness::watch();
    proxy.blackhole();
    let started = Instant::now();
    let silent = within_for(
        "the health check on a silent path",
        PATIENCE,
        backend.health(),
    )
    .await;
    let took = started.elapsed();
    assert!(
        !silent.is_healthy(),
        "conformance: healthy through a silent path: {silent}"
    );
    let bound = lateness.allowing(HEALTH_PROBE_WAIT + 2 * deployment.command_timeout() + SLACK);
    assert!(
        took < bound,
        "conformance: the health check took {took:?} on a silent path (bound {bound:?})"
    );
    tracing::info!(%silent, ?took, "health on a silent path");
    proxy.heal();
    until_healthy(&*backend, "after the heal", 3 * PATIENCE).await;
}

/// Every connection of the holder is reset: the holder is told (before, or within
/// [`Proxied::reset_notice`] after, any other instance is granted), and the backend
/// reconnects for the next acquisition.
pub async fn a_reset_connection_is_a_lost_lease_and_recovers<P: Proxied>(deployment: &P) {
    const CHECK: &str = "a_reset_connection_is_a_lost_lease_and_recovers";
    let (proxy, a, b) = proxied_and_direct(deployment, CHECK).await;
    let guard = a.lock("reset").await.unwrap();
    let signal = guard.lease().expect("a remote lease").clone();
    let told = tokio::spawn(async move {
        signal.lost().await;
        Instant::now()
    });
    proxy.reset();
    // A session lock dies with its connection; a TTL lease survives a reset if the
    // renewal reconnects in time. Either way, no overlap without the signal.
    let wait = 2 * deployment.loss_bound();
    let waiting = Instant::now();
    match b.lock_timeout("reset", wait).await {
        Ok(taken) => {
            let granted = Instant::now();
            let told = within_for("the holder is told", PATIENCE, told)
                .await
                .unwrap();
            let late = told.saturating_duration_since(granted);
            assert!(
                late <= deployment.reset_notice(),
                "conformance: after a reset the holder was told {late:?} after another \
                 instance was granted (bound {:?})",
                deployment.reset_notice()
            );
            // Its renewals went unanswered, or the connection holding the lock broke:
            // the local deadline comes before the engine's, so never "not the owner".
            assert_eq!(guard.lost_reason(), Some(LostReason::Unreachable));
            taken.release().await;
        }
        Err(LockError::Timeout) => {
            assert!(
                !guard.is_lost(),
                "conformance: lost, yet nobody else could take the key"
            )
        }
        // A wait that ran out while its last look at the engine went unanswered (a
        // loaded machine) ends with that failure, not `Timeout`: never granted all the
        // same.
        Err(LockError::Backend(_)) if waiting.elapsed() >= wait => {
            assert!(
                !guard.is_lost(),
                "conformance: lost, yet nobody else could take the key"
            )
        }
        Err(error) => panic!("conformance: b failed: {error}"),
    }
    drop(guard);
    let again = until_granted(&a, "reset-after", "a reconnects").await;
    again.release().await;
}

/// The only path of an instance is dropped while its waiters queue: instance `a`
/// (direct) holds a key, four waiters on `b` (through the proxy) queue for it with waits
/// of 30 s, one after another; every connection of `b` is reset, then its path goes
/// silent for a command timeout and heals; `a` releases. Every waiter is granted before
/// its wait ends, in the order it arrived (`b`'s own queue is FIFO whatever the engine),
/// one at a time, none before `a` released: a broken connection or an unanswered
/// request during a wait is tried again within the wait, never the end of it.
pub async fn a_dropped_path_does_not_end_a_wait<P: Proxied>(deployment: &P) {
    const CHECK: &str = "a_dropped_path_does_not_end_a_wait";
    const WAIT: Duration = Duration::from_secs(30);
    let proxy = FaultProxy::start(deployment.upstream()).await;
    let a = instance(deployment, CHECK).await;
    let b = instance_via(deployment, &proxy, CHECK).await;
    // A connection in use before the fault.
    b.lock("warm").await.unwrap().release().await;
    let guard = a.lock("dropped").await.unwrap();
    let (inside, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let grants = Arc::new(Mutex::new(Vec::new()));
    let before = proxy.round_trips();
    let mut waiters = Vec::new();
    for n in 0..4 {
        let started = Instant::now();
        let mut acquire = b.lock_timeout("dropped", WAIT);
        // Polled once, it has its place in `b`'s queue: the next one arrives after it.
        let polled = Pin::new(&mut acquire).poll(&mut Context::from_waker(Waker::noop()));
        assert!(
            polled.is_pending(),
            "conformance: waiter {n} was not queued"
        );
        let (inside, most, grants) = (inside.clone(), most.clone(), grants.clone());
        waiters.push(tokio::spawn(async move {
            let outcome = acquire.await;
            let granted = Instant::now();
            let guard = outcome.map_err(|error| {
                format!(
                    "waiter {n} failed after {:?} of its {WAIT:?} wait: {error}",
                    granted - started
                )
            })?;
            most.fetch_max(inside.fetch_add(1, SeqCst) + 1, SeqCst);
            grants.lock().unwrap_or_else(PoisonError::into_inner).push((
                n,
                granted,
                started + WAIT,
            ));
            sleep(Duration::from_millis(20)).await;
            inside.fetch_sub(1, SeqCst);
            guard.release().await;
            Ok::<(), String>(())
        }));
    }
    // The first waiter is at the engine: it has sent the server a request since (a
    // blocking lock call is one round trip for as long as it waits).
    within_for("the first waiter reaches the server", PATIENCE, async {
        while proxy.round_trips() <= before {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    proxy.reset();
    sleep(deployment.command_timeout()).await;
    proxy.blackhole();
    sleep(deployment.command_timeout()).await;
    proxy.heal();
    sleep(deployment.command_timeout()).await;
    let released = Instant::now();
    guard.release().await;
    let mut failures = Vec::new();
    for waiter in waiters {
        if let Err(failure) = within_for("every waiter ends", 2 * WAIT, waiter)
            .await
            .unwrap()
        {
            failures.push(failure);
        }
    }
    assert!(
        failures.is_empty(),
        "conformance: waits ended early: {failures:#?}"
    );
    let grants = grants
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let order: Vec<usize> = grants.iter().map(|(n, _, _)| *n).collect();
    assert_eq!(order, [0, 1, 2, 3], "conformance: not in arrival order");
    for (n, granted, wait_ends) in &grants {
        assert!(
            granted < wait_ends,
            "conformance: waiter {n} granted after its wait ended"
        );
        assert!(
            *granted >= released,
            "conformance: waiter {n} granted before the holder released"
        );
    }
    assert_eq!(
        most.load(SeqCst),
        1,
        "conformance: two waiters held the key at once"
    );
    tracing::info!(
        last = ?(grants[3].1 - released),
        "dropped path: 4 waiters granted in order after the release"
    );
}

/// An acquisition that starts while its instance's path is down (every connection
/// reset, new ones silent) is granted once the path heals within its wait: an engine
/// that answered before is not given up on at its first failure, whether that is a
/// dead pooled connection or a connect that goes unanswered. Another acquisition,
/// dropped while it tries again, leaves its key free for another instance.
pub async fn an_outage_that_heals_within_the_wait_is_ridden_out<P: Proxied>(deployment: &P) {
    const CHECK: &str = "an_outage_that_heals_within_the_wait_is_ridden_out";
    const WAIT: Duration = Duration::from_secs(30);
    let proxy = FaultProxy::start(deployment.upstream()).await;
    let a = instance_via(deployment, &proxy, CHECK).await;
    // The engine answered this instance, over a connection kept for the next lock.
    a.lock("outage").await.unwrap().release().await;
    proxy.reset();
    proxy.blackhole();
    let started = Instant::now();
    // Another acquisition, of a key of its own, is dropped while it tries again.
    let cut = tokio::spawn({
        let a = a.clone();
        async move { a.lock_timeout("cut-in-the-outage", WAIT).await }
    });
    let acquire = tokio::spawn(async move {
        let outcome = a.lock_timeout("outage", WAIT).await;
        (outcome, started.elapsed())
    });
    // Down for three command timeouts: at least one attempt meets the dead pooled
    // connection, and one more a connect that is never answered.
    let outage = 3 * deployment.command_timeout();
    sleep(2 * deployment.command_timeout()).await;
    cut.abort();
    sleep(outage - 2 * deployment.command_timeout()).await;
    proxy.heal();
    let (outcome, ended_after) = within_for("the acquisition after the heal", 2 * WAIT, acquire)
        .await
        .expect("the acquisition panicked");
    let guard = outcome.unwrap_or_else(|error| {
        panic!(
            "conformance: an outage of {outage:?} ended a wait of {WAIT:?} after \
             {ended_after:?}: {error}"
        )
    });
    tracing::info!(?outage, granted_after = ?ended_after, "outage: the wait outlasted it");
    guard.release().await;
    // The dropped acquisition left nothing held: another instance takes its key at
    // once, not after a lease (as `dropped_acquisitions_leave_nothing_held` allows).
    let b = instance(deployment, CHECK).await;
    let loss_bound = deployment.loss_bound();
    let within = (loss_bound / 2).max(Duration::from_millis(100));
    eventually_free(&b, "cut-in-the-outage", within, loss_bound * 9 / 10).await;
}

/// Takes `key` on `locks` once the backend serves again, failing after three
/// [`PATIENCE`]s.
async fn until_granted(locks: &DistributedLocks, key: &str, what: &str) -> crate::DistributedGuard {
    within_for(what, 3 * PATIENCE, async {
        loop {
            match locks.lock_timeout(key, PATIENCE).await {
                Ok(guard) => break guard,
                Err(_) => sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
}

/// Asks `backend`'s health check until it says healthy, failing after `limit`.
async fn until_healthy(backend: &dyn LockBackend, when: &str, limit: Duration) {
    within_for(&format!("healthy {when}"), limit, async {
        loop {
            if backend.health().await.is_healthy() {
                break;
            }
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}
