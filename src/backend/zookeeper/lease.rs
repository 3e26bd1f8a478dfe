//! A granted lock: its lost-lease signal, fed by the session's health and a watch on
//! the holder's own node, and its release (the node deleted, retried in the background
//! while the session lives).

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::{timeout_at, Instant};
use zookeeper_client as zk;

use super::contender::Contender;
use super::session::{Health, Session};
use super::Inner;
use crate::backend::ttl::give_back;
use crate::backend::{BoxFuture, Lease, LeaseLostSender, LeaseSignal, LostReason, ReleaseLease};

/// The lease of `contender`, granted with `fence`; `None` if its session was lost
/// meanwhile.
pub(super) fn grant(inner: &Arc<Inner>, contender: Arc<Contender>, fence: u64) -> Option<Lease> {
    let mut health = contender.session.subscribe();
    let now = *health.borrow_and_update();
    if now.lost || Instant::now() >= now.valid_until {
        return None;
    }
    let (lost, signal) = LeaseSignal::with_deadline(now.valid_until);
    let node = contender.node()?.to_owned();
    let keep = tokio::spawn(keep(
        contender.session.clone(),
        node,
        health,
        lost,
        inner.config.settings.command_timeout,
    ));
    let release = ZooKeeperRelease {
        inner: inner.clone(),
        contender,
        keep: keep.abort_handle(),
    };
    Some(Lease::new(Some(fence), signal, release))
}

/// Moves the lease's deadline with the session's, and raises it when the session is
/// lost or the node is deleted (by hand, or the session expired). Aborted when the
/// lease is released.
async fn keep(
    session: Arc<Session>,
    node: String,
    mut health: watch::Receiver<Health>,
    lost: LeaseLostSender,
    command_timeout: std::time::Duration,
) {
    // A watch on the node itself: set up off the grant's path (one round trip).
    let Some(client) = session.client() else {
        lost.lose(LostReason::Unreachable);
        return;
    };
    let watched = timeout_at(
        Instant::now() + command_timeout,
        client.check_and_watch_stat(&node),
    )
    .await;
    drop(client);
    let watcher = match watched {
        Ok(Ok((Some(_), watcher))) => Some(watcher),
        Ok(Ok((None, _))) => {
            lost.lose(LostReason::NotOwner);
            return;
        }
        // Without a watch, the session's health alone decides.
        _ => None,
    };
    let mut watching = watcher.is_some();
    let deleted = async {
        match watcher {
            Some(watcher) => watcher.changed().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deleted);
    // The session lost (its deadline passed unheard, or it closed) is the engine out
    // of reach; the node gone is the engine's word that the lock is not ours.
    let reason = loop {
        tokio::select! {
            changed = health.changed() => {
                let now = *health.borrow_and_update();
                if changed.is_err() || now.lost {
                    break LostReason::Unreachable;
                }
                if now.unanswered {
                    lost.unanswered();
                } else if !lost.extend(now.valid_until) {
                    return; // raised: the deadline had passed
                }
            }
            event = &mut deleted, if watching => {
                // A node watch fires once: deleted, changed by hand, or the session
                // ended. Only a data change leaves the node ours; then the session's
                // health goes on deciding alone.
                match event.event_type {
                    zk::EventType::NodeDataChanged => {
                        watching = false;
                        continue;
                    }
                    zk::EventType::Session => break LostReason::Unreachable,
                    _ => break LostReason::NotOwner,
                }
            }
        }
    };
    lost.lose(reason);
}

/// Gives a lease back: stops following the session, then deletes the node.
struct ZooKeeperRelease {
    inner: Arc<Inner>,
    contender: Arc<Contender>,
    keep: AbortHandle,
}

impl ReleaseLease for ZooKeeperRelease {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        self.keep.abort();
        let now = Instant::now();
        Box::pin(async move {
            let (inner, contender) = (self.inner.clone(), self.contender.clone());
            // The node lives as long as its session: retried until the session is gone
            // (a give-back then finds it cleared). The grant was answered: no write of
            // this contender is still on its way.
            let until = now + inner.give_back_horizon();
            let token = contender.token.clone();
            give_back(&inner, contender, token, until, None).await;
        })
    }
}

impl Drop for ZooKeeperRelease {
    fn drop(&mut self) {
        self.keep.abort();
    }
}
