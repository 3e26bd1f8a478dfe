//! A key held through a fault of a consensus engine (etcd, ZooKeeper): whether the
//! holder kept it, and if another instance got it meanwhile, that the holder was told
//! first.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::{sleep, Instant};
use tower_keyed_lock::{DistributedGuard, DistributedLocks, LockError};

use super::fixtures::{within, PATIENCE};

/// Holds `key` for `hold` while `fault` runs, with another instance waiting for it the
/// whole time. No unsignalled overlap: if the other instance is granted while the
/// holder still holds, the holder's signal was raised when the grant came back (read
/// by the waiter right then, so no task's scheduling delay counts). Returns whether the
/// hold survived (not lost).
pub async fn hold_through(
    holder: &DistributedLocks,
    waiter: DistributedLocks,
    key: &'static str,
    hold: Duration,
    fault: impl std::future::Future<Output = ()>,
) -> bool {
    hold_through_told_late(holder, waiter, key, hold, fault, None).await
}

/// [`hold_through`] on an engine that documents a late notice (etcd without the
/// stale-leader fix: its watch may see the revoked key after the next grant): with
/// `late` set, a grant before the holder was told passes only if the holder's watch
/// saw it within `late` after the grant and the waiter's fencing token is above the
/// holder's, so a fenced write of the holder is still refused.
pub async fn hold_through_told_late(
    holder: &DistributedLocks,
    waiter: DistributedLocks,
    key: &'static str,
    hold: Duration,
    fault: impl std::future::Future<Output = ()>,
    late: Option<Duration>,
) -> bool {
    let guard: DistributedGuard = holder.lock(key).await.unwrap();
    let holder_token = guard.fencing_token();
    let signal = guard.lease().expect("a remote lease").clone();
    let told = tokio::spawn({
        let signal = signal.clone();
        async move {
            signal.lost().await;
            Instant::now()
        }
    });
    let granted = Arc::new(Mutex::new(None));
    let other = tokio::spawn({
        let granted = granted.clone();
        async move {
            loop {
                match waiter.lock_timeout(key, Duration::from_millis(500)).await {
                    Ok(guard) => {
                        *granted.lock().unwrap() = Some((Instant::now(), signal.is_lost()));
                        return guard;
                    }
                    // The cluster or ensemble is electing, or the server this client
                    // chose is down: try again.
                    Err(LockError::Timeout | LockError::Backend(_)) => {}
                    Err(error) => panic!("the waiter failed: {error}"),
                }
            }
        }
    });
    fault.await;
    let end = Instant::now() + hold;
    while Instant::now() < end && !guard.is_lost() {
        sleep(Duration::from_millis(10)).await;
    }
    let survived = !guard.is_lost();
    let released = Instant::now();
    guard.release().await;
    let taken = within("the waiter gets the key", 3 * PATIENCE, other)
        .await
        .unwrap();
    let (granted, told_by_then) = granted.lock().unwrap().expect("granted");
    if granted < released {
        // Granted while the holder still held: it must have been told before.
        let told = within("the holder is told", PATIENCE, told).await.unwrap();
        let told_after = told.saturating_duration_since(granted);
        match late {
            Some(late) if !told_by_then => {
                assert!(
                    told_after <= late,
                    "the holder was told {told_after:?} after the next grant (allowed {late:?})"
                );
                assert!(
                    taken.fencing_token() > holder_token,
                    "told late, and the waiter's token {:?} is not above the holder's {holder_token:?}",
                    taken.fencing_token()
                );
                eprintln!("{key}: holder told {told_after:?} after the grant (documented), tokens in order");
            }
            _ => assert!(
                told_by_then,
                "unsignalled overlap: the waiter was granted while the holder's signal was \
                 not raised (its watcher saw it {told_after:?} later)"
            ),
        }
        eprintln!(
            "{key}: holder told, waiter granted {:?} after its watcher saw it",
            granted.saturating_duration_since(told)
        );
    } else {
        told.abort();
    }
    taken.release().await;
    survived
}
