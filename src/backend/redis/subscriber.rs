//! The release subscription: release messages from Redis wake the waiters of their
//! lock key in this process.
//!
//! On one server every release goes to one shared channel. On a cluster each lock has
//! its own shard channel, named like its lock key and so in its slot: `SPUBLISH` stays
//! on the shard that owns the key, and this process subscribes (`SSUBSCRIBE`) only to
//! the locks it waits for, from the first waiter of a lock to the last.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterConfig;
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Client, PushInfo, PushKind, RedisError, Value};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::time::{sleep, timeout, Instant};

use super::connection::Target;
use crate::backend::ttl::jitter;

/// Backoff of resubscription.
const RESUBSCRIBE_MIN: Duration = Duration::from_millis(50);
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(1);

/// How often the subscription connection is pinged: a ping unanswered within the
/// command timeout means a silent connection, replaced by a fresh subscription.
const KEEPALIVE: Duration = Duration::from_secs(1);

/// Waiters for the release of a lock key, woken by the subscription task.
pub(super) struct Releases {
    waiting: Mutex<HashMap<Arc<str>, Waiters>>,
    /// Cluster only: a lock whose first waiter came or whose last went, for the
    /// subscription task to subscribe to its shard channel or unsubscribe.
    changed: Option<mpsc::UnboundedSender<Arc<str>>>,
}

/// The waiters of one lock key.
struct Waiters {
    notify: Arc<Notify>,
    /// How many `Interest`s share `notify`; the entry goes with the last.
    interests: usize,
    /// Grants announced by releases and not taken yet: token, fencing token. A grant
    /// for a waiter of another backend in this process is never taken, so only the
    /// latest few are kept; a waiter whose grant went finds the key its own at its
    /// next attempt.
    grants: VecDeque<(Box<str>, u64)>,
    /// How many times they were woken for the key being free (or maybe free: a new
    /// subscription), as against for a grant to one of them.
    releases: u64,
    /// When the lease of the last grant announced expires, at the latest.
    granted_until: Option<Instant>,
}

/// How many untaken grants a lock's waiters keep.
const GRANTS_KEPT: usize = 8;

/// A waiter's registration; removes the entry with the last one.
pub(super) struct Interest {
    releases: Arc<Releases>,
    lock: Arc<str>,
    pub(super) notify: Arc<Notify>,
}

impl Releases {
    /// Waiters of a single server, which hears every release on one channel.
    pub(super) fn shared_channel() -> (Arc<Self>, Option<mpsc::UnboundedReceiver<Arc<str>>>) {
        let releases = Self {
            waiting: Mutex::default(),
            changed: None,
        };
        (Arc::new(releases), None)
    }

    /// Waiters on a cluster, whose subscriptions follow them lock by lock.
    pub(super) fn shard_channels() -> (Arc<Self>, Option<mpsc::UnboundedReceiver<Arc<str>>>) {
        let (changed, changes) = mpsc::unbounded_channel();
        let releases = Self {
            waiting: Mutex::default(),
            changed: Some(changed),
        };
        (Arc::new(releases), Some(changes))
    }

    /// Registers a waiter of `lock`. On a cluster its shard channel may not be
    /// subscribed yet: the waiter is woken when it is, and retries.
    pub(super) fn register(self: &Arc<Self>, lock: &Arc<str>) -> Interest {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let waiters = waiting.entry(lock.clone()).or_insert_with(|| {
            // Sent under the lock, so changes reach the task in the order they happen.
            self.announce_change(lock);
            Waiters {
                notify: Arc::new(Notify::new()),
                interests: 0,
                grants: VecDeque::new(),
                releases: 0,
                granted_until: None,
            }
        });
        waiters.interests += 1;
        Interest {
            releases: self.clone(),
            lock: lock.clone(),
            notify: waiters.notify.clone(),
        }
    }

    fn announce_change(&self, lock: &Arc<str>) {
        if let Some(changed) = &self.changed {
            // Fails only once the task has ended with the backend.
            let _ = changed.send(lock.clone());
        }
    }

    fn is_waited(&self, lock: &str) -> bool {
        let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.contains_key(lock)
    }

    fn waited(&self) -> Vec<Arc<str>> {
        let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        waiting.keys().cloned().collect()
    }

    fn wake(&self, lock: &str) {
        let notify = {
            let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting.get_mut(lock).map(|waiters| {
                waiters.releases += 1;
                waiters.notify.clone()
            })
        };
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    /// A release granted `lock` to `token` for `lease`: kept for its waiter. Wakes the
    /// lock's waiters: the one it names takes it, the others wait on, at most `lease`.
    fn grant(&self, lock: &str, token: &str, fence: u64, lease: Duration) {
        let granted_until = Instant::now() + lease;
        let notify = {
            let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting.get_mut(lock).map(|waiters| {
                if waiters.grants.len() == GRANTS_KEPT {
                    waiters.grants.pop_front();
                }
                waiters.grants.push_back((token.into(), fence));
                waiters.granted_until = Some(granted_until);
                waiters.notify.clone()
            })
        };
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    fn wake_all(&self) {
        let all: Vec<_> = {
            let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
            waiting
                .values_mut()
                .map(|waiters| {
                    waiters.releases += 1;
                    waiters.notify.clone()
                })
                .collect()
        };
        for notify in all {
            notify.notify_waiters();
        }
    }
}

impl Interest {
    /// How many times this lock's waiters were woken for a release; a wake-up that
    /// leaves it unchanged announced only grants.
    pub(super) fn releases(&self) -> u64 {
        self.with_waiters(|waiters| waiters.releases).unwrap_or(0)
    }

    /// When the lease of the last grant announced expires, at the latest.
    pub(super) fn granted_until(&self) -> Option<Instant> {
        self.with_waiters(|waiters| waiters.granted_until).flatten()
    }

    fn with_waiters<T>(&self, read: impl FnOnce(&mut Waiters) -> T) -> Option<T> {
        let mut waiting = self
            .releases
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        waiting.get_mut(&self.lock).map(read)
    }

    /// The fencing token of a grant of this lock to `token` that a release announced.
    pub(super) fn take_grant(&self, token: &str) -> Option<u64> {
        self.with_waiters(|waiters| {
            let at = waiters
                .grants
                .iter()
                .position(|(granted, _)| &**granted == token)?;
            waiters.grants.remove(at).map(|(_, fence)| fence)
        })
        .flatten()
    }
}

impl Drop for Interest {
    fn drop(&mut self) {
        let releases = &self.releases;
        let mut waiting = releases
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(waiters) = waiting.get_mut(&self.lock) {
            waiters.interests -= 1;
            if waiters.interests == 0 {
                waiting.remove(&self.lock);
                releases.announce_change(&self.lock);
            }
        }
    }
}

/// The release subscription: one RESP3 connection whose push messages wake waiters.
pub(super) struct Subscriber {
    target: Target,
    /// The shared release channel of a single server.
    channel: String,
    timeout: Duration,
}

/// A subscribed connection, its push messages and, on a cluster, the locks whose
/// shard channels it is subscribed to.
pub(super) struct Subscription {
    connection: Subscribed,
    messages: mpsc::UnboundedReceiver<PushInfo>,
    shard_channels: HashSet<Arc<str>>,
}

/// The connection that holds the subscription.
enum Subscribed {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Subscribed {
    async fn ping(&mut self) -> Result<(), RedisError> {
        // On a cluster PING goes to every primary: a silent shard is noticed too.
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

    /// Connects within the command timeout and subscribes: to the shared channel of a
    /// single server, or to the shard channel of every lock waited for now on a
    /// cluster (each command bounded by the connection's response timeout).
    pub(super) async fn subscribe(
        &self,
        releases: &Arc<Releases>,
    ) -> Result<Subscription, RedisError> {
        let (others, messages) = mpsc::unbounded_channel();
        let sender = wake_on_release(releases.clone(), others);
        let mut shard_channels = HashSet::new();
        let connection = match &self.target {
            Target::Single(client) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout))
                    .set_push_sender(sender);
                let connect = async {
                    let mut connection = client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?;
                    connection.subscribe(&self.channel).await?;
                    Ok::<_, RedisError>(connection)
                };
                Subscribed::Single(self.within_timeout(connect).await?)
            }
            Target::Cluster(client) => {
                let config = ClusterConfig::new()
                    .set_connection_timeout(self.timeout)
                    .set_response_timeout(self.timeout)
                    .set_push_sender(sender);
                let connect = async {
                    let mut connection = client.get_async_connection_with_config(config).await?;
                    redis::cmd("PING")
                        .query_async::<()>(&mut connection)
                        .await?;
                    Ok::<_, RedisError>(connection)
                };
                let mut connection = self.within_timeout(connect).await?;
                for lock in releases.waited() {
                    connection.ssubscribe(&*lock).await?;
                    shard_channels.insert(lock);
                }
                Subscribed::Cluster(connection)
            }
        };
        Ok(Subscription {
            connection,
            messages,
            shard_channels,
        })
    }

    async fn within_timeout<T>(
        &self,
        step: impl std::future::Future<Output = Result<T, RedisError>>,
    ) -> Result<T, RedisError> {
        timeout(self.timeout, step).await.unwrap_or_else(|_| {
            Err(RedisError::from((
                redis::ErrorKind::Io,
                "timed out",
                "subscribing to releases".to_owned(),
            )))
        })
    }

    /// Keeps the subscription up until `stop` resolves (the backend is gone);
    /// resubscribes with backoff whenever the connection fails. `changes` (cluster
    /// only) names the locks whose waiters came or went.
    pub(super) async fn run(
        self,
        first: Subscription,
        releases: Arc<Releases>,
        mut changes: Option<mpsc::UnboundedReceiver<Arc<str>>>,
        subscribed: watch::Sender<bool>,
        mut stop: oneshot::Receiver<()>,
    ) {
        let mut current = Some(first);
        let mut backoff = RESUBSCRIBE_MIN;
        loop {
            let subscription = match current.take() {
                Some(subscription) => subscription,
                None => {
                    // The fresh subscription covers every lock waited for when it is
                    // made, so what changed before it needs no more attention.
                    if let Some(changes) = &mut changes {
                        while changes.try_recv().is_ok() {}
                    }
                    let result = tokio::select! {
                        biased;
                        _ = &mut stop => return,
                        result = self.subscribe(&releases) => result,
                    };
                    match result {
                        Ok(subscription) => {
                            tracing::debug!("redis release subscription restored");
                            // Releases while unsubscribed went unheard: everyone retries.
                            releases.wake_all();
                            subscription
                        }
                        Err(_) => {
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
            let stopped = self
                .listen(subscription, &releases, &mut changes, &mut stop)
                .await;
            subscribed.send_replace(false);
            if stopped {
                return;
            }
            tracing::debug!("redis release subscription lost; resubscribing");
        }
    }

    /// Watches the connection (release messages wake waiters in its push sender) until
    /// it fails (`false`) or `stop` resolves (`true`).
    async fn listen(
        &self,
        subscription: Subscription,
        releases: &Releases,
        changes: &mut Option<mpsc::UnboundedReceiver<Arc<str>>>,
        stop: &mut oneshot::Receiver<()>,
    ) -> bool {
        let Subscription {
            mut connection,
            mut messages,
            mut shard_channels,
        } = subscription;
        let mut keepalive = tokio::time::interval(KEEPALIVE);
        keepalive.tick().await;
        loop {
            // The lock whose shard channel to bring in line with its waiters.
            let lock = tokio::select! {
                biased;
                _ = &mut *stop => return true,
                message = messages.recv() => match message {
                    None => return false,
                    Some(push) => match push.kind {
                        PushKind::Disconnection => return false,
                        // Not asked for (those leave the set first): the server
                        // dropped the channel because its slot moved to another node.
                        PushKind::SUnsubscribe => match text(push.data.first()) {
                            Some(lock) => match shard_channels.take(lock) {
                                Some(lock) => lock,
                                None => continue,
                            },
                            None => continue,
                        },
                        _ => continue,
                    },
                },
                Some(lock) = next_change(changes) => lock,
                _ = keepalive.tick() => {
                    let answer = timeout(self.timeout, connection.ping()).await;
                    if !matches!(answer, Ok(Ok(()))) {
                        return false;
                    }
                    continue;
                }
            };
            let Subscribed::Cluster(cluster) = &mut connection else {
                continue;
            };
            if follow(cluster, &mut shard_channels, releases, lock)
                .await
                .is_err()
            {
                return false;
            }
        }
    }
}

/// The connection's push sender: a release message wakes its lock's waiters right
/// where the connection reads it, with no hop through the subscription task (a hop is
/// a scheduling round on the hand-off's path); every other push goes to that task.
fn wake_on_release(
    releases: Arc<Releases>,
    others: mpsc::UnboundedSender<PushInfo>,
) -> impl Fn(PushInfo) -> Result<(), mpsc::error::SendError<PushInfo>> + Send + Sync + 'static {
    move |push: PushInfo| {
        if matches!(push.kind, PushKind::Message | PushKind::SMessage) {
            match text(push.data.get(1)).map(Announced::parse) {
                Some(Announced::Released(lock)) => releases.wake(lock),
                Some(Announced::Granted {
                    lock,
                    token,
                    fence,
                    lease,
                }) => releases.grant(lock, token, fence, lease),
                None => {}
            }
            return Ok(());
        }
        others.send(push)
    }
}

/// What a release message says (see `scripts::RELEASE`).
#[derive(Debug, PartialEq, Eq)]
enum Announced<'a> {
    /// `lock`: the key is free.
    Released(&'a str),
    /// `lock\ntoken\nfencing token\nlease ms`: the key was handed to a queued waiter.
    /// Split from the right: a token is hex, a fencing token and a lease digits, a lock
    /// key may be anything.
    Granted {
        lock: &'a str,
        token: &'a str,
        fence: u64,
        lease: Duration,
    },
}

impl<'a> Announced<'a> {
    fn parse(message: &'a str) -> Self {
        let granted = || {
            let (rest, lease) = message.rsplit_once('\n')?;
            let (rest, fence) = rest.rsplit_once('\n')?;
            let (lock, token) = rest.rsplit_once('\n')?;
            Some(Self::Granted {
                lock,
                token,
                fence: fence.parse().ok()?,
                lease: Duration::from_millis(lease.parse().ok()?),
            })
        };
        granted().unwrap_or(Self::Released(message))
    }
}

/// Subscribes to `lock`'s shard channel if it has waiters and unsubscribes if not.
/// A new subscription wakes the waiters: a release before it went unheard.
async fn follow(
    connection: &mut ClusterConnection,
    shard_channels: &mut HashSet<Arc<str>>,
    releases: &Releases,
    lock: Arc<str>,
) -> Result<(), RedisError> {
    let waited = releases.is_waited(&lock);
    if waited && !shard_channels.contains(&lock) {
        connection.ssubscribe(&*lock).await?;
        shard_channels.insert(lock.clone());
        releases.wake(&lock);
    } else if !waited && shard_channels.remove(&lock) {
        // A failure here leaves a subscription no one listens to; the keepalive
        // finds out whether the connection is gone.
        if let Err(error) = connection.sunsubscribe(&*lock).await {
            tracing::debug!(%error, "redis shard channel unsubscribe failed");
        }
    }
    Ok(())
}

/// The next lock whose waiters changed; never, on a single server.
async fn next_change(changes: &mut Option<mpsc::UnboundedReceiver<Arc<str>>>) -> Option<Arc<str>> {
    match changes {
        Some(changes) => changes.recv().await,
        None => std::future::pending().await,
    }
}

/// A push message's text field.
fn text(value: Option<&Value>) -> Option<&str> {
    match value {
        Some(Value::BulkString(bytes)) => std::str::from_utf8(bytes).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interests_share_an_entry_and_remove_it_with_the_last() {
        let (releases, _) = Releases::shared_channel();
        let lock: Arc<str> = "k".into();
        let a = releases.register(&lock);
        let b = releases.register(&lock);
        assert!(Arc::ptr_eq(&a.notify, &b.notify));
        drop(a);
        assert_eq!(releases.waiting.lock().unwrap().len(), 1);
        drop(b);
        assert!(releases.waiting.lock().unwrap().is_empty());
    }

    #[test]
    fn a_release_message_wakes_its_waiters_where_it_is_read() {
        let (releases, _) = Releases::shared_channel();
        let (others, mut forwarded) = mpsc::unbounded_channel();
        let sender = wake_on_release(releases.clone(), others);
        let interest = releases.register(&"{t}:lock".into());
        let mut woken = std::pin::pin!(interest.notify.notified());
        woken.as_mut().enable();
        let message = |kind, lock: &str| PushInfo {
            kind,
            data: vec![
                Value::BulkString(b"release".to_vec()),
                Value::BulkString(lock.as_bytes().to_vec()),
            ],
        };
        sender(message(PushKind::Message, "{t}:lock")).unwrap();
        // Woken at once, with no task in between; nothing is forwarded.
        let waker = std::task::Waker::noop();
        let mut context = std::task::Context::from_waker(waker);
        assert!(woken.as_mut().poll(&mut context).is_ready());
        assert!(forwarded.try_recv().is_err());
        sender(message(PushKind::Subscribe, "release")).unwrap();
        assert_eq!(forwarded.try_recv().unwrap().kind, PushKind::Subscribe);
    }

    #[test]
    fn a_message_is_a_release_or_a_grant() {
        assert_eq!(
            Announced::parse("{t}:lock"),
            Announced::Released("{t}:lock")
        );
        assert_eq!(
            Announced::parse("{a\nb}:lock\n0f3a\n1700000000000001\n30000"),
            Announced::Granted {
                lock: "{a\nb}:lock",
                token: "0f3a",
                fence: 1_700_000_000_000_001,
                lease: Duration::from_secs(30),
            }
        );
        // Not a grant unless its last two lines are numbers.
        for odd in ["{a}:lock\nx\ny\n1", "{a}:lock\nx\n1\ny", "{a}:lock\n1\n1"] {
            assert_eq!(Announced::parse(odd), Announced::Released(odd));
        }
    }

    #[test]
    fn a_grant_is_taken_by_its_token_only_once() {
        let (releases, _) = Releases::shared_channel();
        let lock: Arc<str> = "{t}:lock".into();
        let interest = releases.register(&lock);
        let mut woken = std::pin::pin!(interest.notify.notified());
        woken.as_mut().enable();
        releases.grant("{t}:lock", "ab", 7, Duration::from_secs(1));
        releases.grant("{other}:lock", "ab", 8, Duration::from_secs(1));
        let waker = std::task::Waker::noop();
        let mut context = std::task::Context::from_waker(waker);
        assert!(woken.as_mut().poll(&mut context).is_ready());
        assert_eq!(interest.take_grant("cd"), None);
        assert_eq!(interest.take_grant("ab"), Some(7));
        assert_eq!(interest.take_grant("ab"), None);
        // A grant is not a release: the waiters it does not name wait on.
        assert_eq!(interest.releases(), 0);
        releases.wake("{t}:lock");
        assert_eq!(interest.releases(), 1);
        releases.wake_all();
        assert_eq!(interest.releases(), 2);
        // Only the latest are kept.
        for fence in 0..20 {
            releases.grant(
                "{t}:lock",
                &format!("t{fence}"),
                fence,
                Duration::from_secs(1),
            );
        }
        assert_eq!(interest.take_grant("t0"), None);
        assert_eq!(interest.take_grant("t19"), Some(19));
    }

    #[test]
    fn shard_channels_hear_of_the_first_waiter_and_the_last() {
        let (releases, changes) = Releases::shard_channels();
        let mut changes = changes.unwrap();
        let lock: Arc<str> = "{t}:lock".into();
        let a = releases.register(&lock);
        let b = releases.register(&lock);
        assert_eq!(changes.try_recv().as_deref().ok(), Some("{t}:lock"));
        assert!(changes.try_recv().is_err(), "only the first waiter is news");
        drop(a);
        assert!(changes.try_recv().is_err());
        drop(b);
        assert_eq!(changes.try_recv().as_deref().ok(), Some("{t}:lock"));
        assert!(!releases.is_waited(&lock));
    }
}
