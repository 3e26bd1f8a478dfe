//! The release subscription: release messages from Redis wake the waiters of their
//! lock key in this process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterConfig;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Client, PushInfo, PushKind, RedisError};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::time::{sleep, timeout};

use super::connection::Target;
use super::{jitter, RESUBSCRIBE_MAX, RESUBSCRIBE_MIN};

/// How often the subscription connection is pinged: a ping unanswered within the
/// command timeout means a silent connection, replaced by a fresh subscription.
const KEEPALIVE: Duration = Duration::from_secs(1);

/// Waiters for the release of a lock key, woken by the subscription task.
#[derive(Default)]
pub(super) struct Releases {
    waiting: Mutex<HashMap<Arc<str>, Waiters>>,
}

/// The waiters of one lock key.
struct Waiters {
    notify: Arc<Notify>,
    /// How many `Interest`s share `notify`; the entry goes with the last.
    interests: usize,
}

/// A waiter's registration; removes the entry with the last one.
pub(super) struct Interest {
    releases: Arc<Releases>,
    lock: Arc<str>,
    pub(super) notify: Arc<Notify>,
}

impl Releases {
    pub(super) fn register(self: &Arc<Self>, lock: &Arc<str>) -> Interest {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let waiters = waiting.entry(lock.clone()).or_insert_with(|| Waiters {
            notify: Arc::new(Notify::new()),
            interests: 0,
        });
        waiters.interests += 1;
        Interest {
            releases: self.clone(),
            lock: lock.clone(),
            notify: waiters.notify.clone(),
        }
    }

    fn wake(&self, lock: &str) {
        let notify = {
            let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting.get(lock).map(|waiters| waiters.notify.clone())
        };
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        let all: Vec<_> = {
            let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting
                .values()
                .map(|waiters| waiters.notify.clone())
                .collect()
        };
        for notify in all {
            notify.notify_waiters();
        }
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut waiting = self
            .releases
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(waiters) = waiting.get_mut(&self.lock) {
            waiters.interests -= 1;
            if waiters.interests == 0 {
                waiting.remove(&self.lock);
            }
        }
    }
}

/// The release subscription: one RESP3 connection whose push messages wake waiters.
pub(super) struct Subscriber {
    target: Target,
    channel: String,
    timeout: Duration,
}

/// A subscribed connection and its push messages.
type Subscription = (Subscribed, mpsc::UnboundedReceiver<PushInfo>);

/// The connection that holds the subscription.
pub(super) enum Subscribed {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Subscribed {
    async fn ping(&mut self) -> Result<(), RedisError> {
        let ping = redis::cmd("PING");
        match self {
            Self::Single(connection) => ping.query_async(connection).await,
            Self::Cluster(connection) => ping.query_async(connection).await,
        }
    }
}

impl Subscriber {
    /// A cluster client must speak RESP3 already (it cannot be changed here).
    pub(super) fn new(
        target: &Target,
        channel: String,
        timeout: Duration,
    ) -> Result<Self, RedisError> {
        let target = match target {
            // Push messages need RESP3, whatever the command connection speaks.
            Target::Single(client) => {
                let info = client.get_connection_info().clone();
                let settings = info
                    .redis_settings()
                    .clone()
                    .set_protocol(redis::ProtocolVersion::RESP3);
                Target::Single(Client::open(info.set_redis_settings(settings))?)
            }
            Target::Cluster(client) => Target::Cluster(client.clone()),
        };
        Ok(Self {
            target,
            channel,
            timeout,
        })
    }

    pub(super) async fn subscribe(&self) -> Result<Subscription, RedisError> {
        let (sender, receiver) = mpsc::unbounded_channel();
        let connection = match &self.target {
            Target::Single(client) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout))
                    .set_push_sender(sender);
                let mut connection = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                connection.subscribe(&self.channel).await?;
                Subscribed::Single(connection)
            }
            // Releases are published with PUBLISH, which a cluster broadcasts to every
            // node: one subscription anywhere hears them all, and the cluster
            // connection moves it to another node when its node fails.
            Target::Cluster(client) => {
                let config = ClusterConfig::new()
                    .set_connection_timeout(self.timeout)
                    .set_response_timeout(self.timeout)
                    .set_push_sender(sender);
                let mut connection = client.get_async_connection_with_config(config).await?;
                connection.subscribe(&self.channel).await?;
                Subscribed::Cluster(connection)
            }
        };
        Ok((connection, receiver))
    }

    /// Delivers release messages until `stop` resolves (the backend is gone);
    /// resubscribes with backoff whenever the connection fails.
    pub(super) async fn run(
        self,
        first: Subscription,
        releases: Arc<Releases>,
        subscribed: watch::Sender<bool>,
        mut stop: oneshot::Receiver<()>,
    ) {
        let mut current = Some(first);
        let mut backoff = RESUBSCRIBE_MIN;
        loop {
            let subscription = match current.take() {
                Some(subscription) => subscription,
                None => {
                    let attempt = timeout(self.timeout, self.subscribe());
                    let result = tokio::select! {
                        biased;
                        _ = &mut stop => return,
                        result = attempt => result,
                    };
                    match result {
                        Ok(Ok(subscription)) => {
                            tracing::debug!("redis release subscription restored");
                            // Releases while unsubscribed went unheard: everyone retries.
                            releases.wake_all();
                            subscription
                        }
                        Ok(Err(_)) | Err(_) => {
                            tokio::select! {
                                biased;
                                _ = &mut stop => return,
                                () = sleep(jitter(backoff)) => {}
                            }
                            backoff = (backoff * 2).min(RESUBSCRIBE_MAX);
                            continue;
                        }
                    }
                }
            };
            backoff = RESUBSCRIBE_MIN;
            subscribed.send_replace(true);
            let stopped = self.listen(subscription, &releases, &mut stop).await;
            subscribed.send_replace(false);
            if stopped {
                return;
            }
            tracing::debug!("redis release subscription lost; resubscribing");
        }
    }

    /// Wakes waiters until the connection fails (`false`) or `stop` resolves (`true`).
    async fn listen(
        &self,
        (mut connection, mut messages): Subscription,
        releases: &Releases,
        stop: &mut oneshot::Receiver<()>,
    ) -> bool {
        let mut keepalive = tokio::time::interval(KEEPALIVE);
        keepalive.tick().await;
        loop {
            tokio::select! {
                biased;
                _ = &mut *stop => return true,
                message = messages.recv() => match message {
                    None => return false,
                    Some(push) => match push.kind {
                        PushKind::Disconnection => return false,
                        PushKind::Message => {
                            if let Some(redis::Value::BulkString(lock)) = push.data.get(1) {
                                if let Ok(lock) = std::str::from_utf8(lock) {
                                    releases.wake(lock);
                                }
                            }
                        }
                        _ => {}
                    },
                },
                _ = keepalive.tick() => {
                    let answer = timeout(self.timeout, connection.ping()).await;
                    if !matches!(answer, Ok(Ok(()))) {
                        return false;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interests_share_an_entry_and_remove_it_with_the_last() {
        let releases = Arc::new(Releases::default());
        let lock: Arc<str> = "k".into();
        let a = releases.register(&lock);
        let b = releases.register(&lock);
        assert!(Arc::ptr_eq(&a.notify, &b.notify));
        drop(a);
        assert_eq!(releases.waiting.lock().unwrap().len(), 1);
        drop(b);
        assert!(releases.waiting.lock().unwrap().is_empty());
    }
}
