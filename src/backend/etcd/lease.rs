//! etcd's steps of the TTL-lease engine: the queue (a contender's key under the lock's
//! prefix, attached to its own etcd lease), the wait on the predecessor's deletion,
//! keep-alive as renewal and lease revocation as give-back. The life cycle around them
//! (validity deadline, renewal every lease/3, background give-back, the in-flight
//! guard) is the engine's (`backend::ttl`).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    GetOptions, LeaseClient, LeaseKeepAliveStream, LeaseKeeper, PutOptions, SortOrder, SortTarget,
    Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use tokio::sync::{watch, Mutex as AsyncMutex};
use tokio::time::{sleep, sleep_until, timeout_at, Instant};

use super::failure::{backend, lease_not_found, step, EtcdLockError, Failure};
use super::keys::LockKeys;
use super::Inner;
use crate::backend::ttl::{self, jitter, Backoff, GiveBack, InFlight, Renewal, Timing, TtlBackend};
use crate::backend::Lease;
use crate::LockError;

/// The first pause before a look at the queue that failed is made again (growing to
/// the poll interval), so a failing member is not hammered; the wait's deadline still
/// bounds it.
const RELOOK_PAUSE: Duration = Duration::from_millis(50);

/// The first pause before a contender that lost its place queues again (growing to
/// the poll interval).
const REQUEUE_PAUSE: Duration = Duration::from_millis(5);

/// One contender: its etcd lease, the key attached to it, the keep-alive stream and
/// the watch on its own key.
pub(super) struct Contender {
    pub(super) lease: i64,
    pub(super) key: String,
    /// One keep-alive stream for the contender's life: a renewal is one message each
    /// way. Locked by the one renewal in progress; `None` until the first renewal and
    /// after a failed one (a late answer on a stream dropped is never counted for a
    /// later send).
    keeper: AsyncMutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// Set when the watch on the holder's own key sees it deleted (by hand, or its
    /// lease revoked or run out): the lease is lost at once (see `TtlBackend::gone`).
    deleted: watch::Sender<bool>,
}

impl Contender {
    fn new(lease: i64, key: String) -> Self {
        Self {
            lease,
            key,
            keeper: AsyncMutex::new(None),
            deleted: watch::Sender::new(false),
        }
    }

    /// Whether the watch on the holder's own key saw it deleted.
    fn is_deleted(&self) -> bool {
        *self.deleted.borrow()
    }

    pub(super) fn mark_deleted(&self) {
        self.deleted.send_replace(true);
    }

    /// Resolves once the holder's key is seen deleted.
    async fn deletion(&self) {
        let mut deleted = self.deleted.subscribe();
        if deleted.wait_for(|deleted| *deleted).await.is_err() {
            // Never: the sender lives as long as the contender.
            std::future::pending::<()>().await;
        }
    }
}

/// What one look at the queue found.
enum Queue {
    /// No older contender: the lock is ours.
    First,
    /// The newest older contender's key.
    Behind(Vec<u8>),
}

/// What one round of contention (one lease, one place in the queue) came to.
enum Round {
    Granted(Lease),
    /// The contender's place is gone (its lease ran out at etcd, or joining the queue
    /// failed): join again with a new lease if the wait allows, else fail with this.
    Requeue(LockError),
}

/// What a wait that ends now returns: the failure of the last look if none was
/// answered since (etcd could not be read), else a timeout.
fn out_of_time(failing: Option<LockError>) -> LockError {
    failing.unwrap_or(LockError::Timeout)
}

impl Inner {
    /// Queues for the lock until granted or the wait ends. A contender whose place is
    /// gone (its lease ran out at etcd, or joining the queue failed) joins again with a
    /// new lease, behind those queued meanwhile, as long as the wait lasts.
    pub(super) async fn acquire(
        self: Arc<Self>,
        keys: LockKeys,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let deadline = ttl::deadline_after(wait);
        // The first round's lease and queue requests may run a command timeout past a
        // shorter wait (a zero wait still tries once); a later round's end with it.
        let mut budget = deadline.max(Instant::now() + self.config.command_timeout);
        let mut backoff = Backoff::new(REQUEUE_PAUSE, self.config.poll_interval);
        // A later round follows a lost place: its grant was contended.
        let mut requeued = false;
        loop {
            match self.contend(&keys, deadline, budget, requeued).await? {
                Round::Granted(lease) => return Ok(lease),
                Round::Requeue(why) => {
                    requeued = true;
                    let pause = backoff.pause();
                    if Instant::now() + pause >= deadline {
                        return Err(why);
                    }
                    tracing::debug!(error = %why, "etcd contender lost its place; queueing again");
                    sleep(pause).await;
                    budget = deadline;
                }
            }
        }
    }

    /// One round: a lease, a place in the queue, and the wait for every older
    /// contender to leave. Requests of the lease and the queue end by `budget`; the
    /// wait ends at `deadline`. `requeued`: a round before lost its place.
    async fn contend(
        self: &Arc<Self>,
        keys: &LockKeys,
        deadline: Instant,
        budget: Instant,
        requeued: bool,
    ) -> Result<Round, LockError> {
        let command_timeout = self.config.command_timeout;

        // 1. A lease of this contender's own: a spare granted ahead (see `spares.rs`)
        // while one has most of its lease left, else granted now; one more spare for
        // the next. A grant whose answer never comes leaves a lease with no key
        // attached, which expires by itself.
        let spare = self.spares.take(self.config.lease / 3);
        self.grant_spare();
        let (lease, granted_at) = match spare {
            Some(spare) => spare,
            None => {
                let granted_at = Instant::now();
                let grant = step(budget, command_timeout, || {
                    let mut leases = self.client.lease_client();
                    let ttl = self.ttl;
                    async move { leases.grant(ttl, None).await }
                })
                .await
                .map_err(|failure| failure.into_error("granting a lease"))?;
                if grant.ttl() <= 0 {
                    return Err(backend(EtcdLockError::Unexpected(
                        "a lease granted without TTL",
                    )));
                }
                (grant.id(), granted_at)
            }
        };
        let contender = Arc::new(Contender::new(lease, keys.contender(lease)));
        // From here on, dropping the guard (an error, the wait over, the future
        // dropped) revokes the lease, which deletes the contender's key with it.
        let mut in_flight = InFlight::new(self.clone(), contender.clone(), String::new());
        in_flight.sent(granted_at);
        // Invariant: the lease lives at etcd at least until `confirmed + lease` (the
        // send time of its grant, or of its last keep-alive that was answered; a
        // retried step counts from its first send, earlier).
        let mut confirmed = granted_at;

        // 2. Join the queue: the key, attached to the lease, and in the same
        // transaction the oldest contender and the key itself. The key's create
        // revision is its place in the queue and the fencing token. A retried
        // transaction puts the same key again: its create revision stays. Retried only
        // while the lease is surely alive (nothing renews it yet).
        let join_until = budget.min(self.valid_until(confirmed));
        let joined = step(join_until, command_timeout, || {
            let mut kv = self.client.kv_client();
            let queued = Txn::new().and_then([
                TxnOp::put(
                    contender.key.as_bytes(),
                    self.config.instance_id.as_bytes(),
                    Some(PutOptions::new().with_lease(contender.lease)),
                ),
                TxnOp::get(keys.queue.as_bytes(), Some(oldest())),
                TxnOp::get(
                    contender.key.as_bytes(),
                    Some(GetOptions::new().with_keys_only()),
                ),
            ]);
            async move { kv.txn(queued).await }
        })
        .await;
        let answer = match joined {
            Ok(answer) => answer,
            // The lease ran out before the key was put: a new one, a new place.
            Err(Failure::Etcd(error)) if lease_not_found(&error) => {
                return Ok(Round::Requeue(backend(EtcdLockError::LeaseLostWhileQueued)))
            }
            Err(failure) if failure.transient() && Instant::now() < deadline => {
                return Ok(Round::Requeue(failure.into_error("joining the queue")))
            }
            Err(failure) => return Err(failure.into_error("joining the queue")),
        };
        let (_, place) = first_key(&answer, 2)
            .ok_or_else(|| backend(EtcdLockError::Unexpected("the key just put is not there")))?;
        let mut first =
            first_key(&answer, 1).map(|(key, _)| key).as_deref() == Some(contender.key.as_bytes());
        // Queued behind an older contender, or again: the grant was contended.
        let contended = requeued || !first;

        // 3. Wait for every older contender to leave: watch the newest older one's
        // key, look again when it is deleted (or the backstop poll fires), keep this
        // waiter's lease alive meanwhile, and stop at the deadline. A look that fails
        // for a transient reason is tried again after a jittered pause: only the wait
        // bounds the waiting, and only etcd's word that the lease is gone ends the
        // place.
        let period = self.config.lease / 3;
        let mut next_keep_alive = confirmed + period;
        let mut retry = Backoff::new(RELOOK_PAUSE, self.config.poll_interval);
        // Why the last look failed, if none was answered since: what the wait ends
        // with if it ends now (else a timeout).
        let mut failing: Option<LockError> = None;
        // The watch on the predecessor's key, made before the look that found it there.
        let mut watching = None;
        loop {
            let mut predecessor = None;
            if !first {
                let now = Instant::now();
                if now >= deadline {
                    return Err(out_of_time(failing));
                }
                let limit = (now + command_timeout).min(deadline);
                match self.look(keys, &contender, place, limit).await {
                    Ok(Queue::First) => first = true,
                    Ok(Queue::Behind(key)) => {
                        failing = None;
                        retry = Backoff::new(RELOOK_PAUSE, self.config.poll_interval);
                        predecessor = Some(key);
                    }
                    Err(Failure::Gone) => {
                        return Ok(Round::Requeue(backend(EtcdLockError::LeaseLostWhileQueued)))
                    }
                    Err(failure) if failure.transient() => {
                        tracing::debug!("etcd queue read failed; looking again");
                        failing = Some(failure.into_error("reading the queue"));
                    }
                    Err(failure) => return Err(failure.into_error("reading the queue")),
                }
            }
            if first {
                if Instant::now() < self.valid_until(confirmed) {
                    in_flight.granted();
                    self.watches.holder(&contender, place);
                    let fence = u64::try_from(place).ok();
                    let lease = ttl::grant(self, contender, String::new(), fence, confirmed);
                    return Ok(Round::Granted(lease.with_contention(contended)));
                }
                // The place is ours, but the lease is not known to live long enough:
                // renew it now, then look again.
                first = false;
                next_keep_alive = Instant::now();
            }

            // A watch on the predecessor's key (on the backend's one stream, see
            // `watches.rs`), then a look again: a deletion cannot slip between.
            match predecessor {
                Some(key) if watching.as_ref().is_none_or(|(watched, _)| *watched != key) => {
                    let mut deletion = self.watches.waiter(key.clone());
                    let limit = (Instant::now() + command_timeout).min(deadline);
                    watching = None;
                    if timeout_at(limit, deletion.created()).await == Ok(true) {
                        watching = Some((key, deletion));
                        continue;
                    }
                }
                Some(_) => {}
                None => watching = None,
            }
            // Without a watch (not made, or the look failed), look again soon.
            let backstop = Instant::now()
                + match watching {
                    Some(_) => jitter(self.config.poll_interval),
                    None => retry.pause(),
                };
            loop {
                let seen = async {
                    match watching.as_mut() {
                        Some((_, deletion)) => deletion.seen().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    () = sleep_until(deadline) => return Err(out_of_time(failing)),
                    () = sleep_until(next_keep_alive) => {
                        let sent = Instant::now();
                        let limit = (sent + command_timeout).min(deadline);
                        match self.keep_alive(&contender, limit).await {
                            Renewal::Renewed => {
                                confirmed = sent;
                                in_flight.sent(sent);
                                next_keep_alive = sent + period;
                            }
                            Renewal::NotOurs => {
                                return Ok(Round::Requeue(backend(
                                    EtcdLockError::LeaseLostWhileQueued,
                                )))
                            }
                            // A waiter holds nothing: it keeps its place for as long
                            // as etcd keeps its lease, and asks again.
                            Renewal::Unknown => next_keep_alive = Instant::now() + period / 4,
                        }
                    }
                    () = sleep_until(backstop) => break,
                    // Seen, or gone: the next look makes a new watch if it is needed.
                    () = seen => {
                        watching = None;
                        break;
                    }
                }
            }
        }
    }

    /// Until when a lease whose grant or last keep-alive was sent at `sent` is
    /// ours, modulo drift: the engine's rule, for the waiting contender.
    fn valid_until(&self, sent: Instant) -> Instant {
        self.timing().valid_until(sent, self.config.lease)
    }

    /// Looks at the queue: whether the contender is still in it, and the newest
    /// contender older than it (created before `place`).
    async fn look(
        &self,
        keys: &LockKeys,
        contender: &Contender,
        place: i64,
        limit: Instant,
    ) -> Result<Queue, Failure> {
        let older = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_max_create_revision(place - 1)
            .with_limit(1)
            .with_keys_only();
        let look = Txn::new().and_then([
            TxnOp::get(keys.queue.as_bytes(), Some(older)),
            TxnOp::get(
                contender.key.as_bytes(),
                Some(GetOptions::new().with_keys_only()),
            ),
        ]);
        let answer = step(limit, self.config.command_timeout, || {
            let mut kv = self.client.kv_client();
            let look = look.clone();
            async move { kv.txn(look).await }
        })
        .await?;
        if first_key(&answer, 1).is_none() {
            return Err(Failure::Gone);
        }
        Ok(match first_key(&answer, 0) {
            None => Queue::First,
            Some((key, _)) => Queue::Behind(key),
        })
    }

    /// Keeps the contender's lease alive: one message each way on its keep-alive
    /// stream (opened by the first renewal). "Not ours" when etcd answers that the
    /// lease is gone, or the watch on the holder's key saw it deleted.
    async fn keep_alive(&self, contender: &Contender, limit: Instant) -> Renewal {
        if contender.is_deleted() {
            return Renewal::NotOurs;
        }
        let mut slot = contender.keeper.lock().await;
        let leases = self.client.lease_client();
        let answer = timeout_at(limit, renew_on(&mut slot, leases, contender.lease)).await;
        let renewal = match answer {
            Ok(Ok(true)) => Renewal::Renewed,
            Ok(Ok(false)) => Renewal::NotOurs,
            Ok(Err(error)) if lease_not_found(&error) => Renewal::NotOurs,
            Ok(Err(error)) => {
                tracing::debug!(%error, "etcd lease keep-alive failed");
                Renewal::Unknown
            }
            Err(_) => Renewal::Unknown,
        };
        if !matches!(renewal, Renewal::Renewed) {
            // A late answer on this stream must not count for a later send.
            *slot = None;
        }
        if contender.is_deleted() {
            return Renewal::NotOurs;
        }
        renewal
    }

    /// Revokes the contender's lease (its key goes with it); one try.
    async fn revoke(&self, contender: &Contender) -> GiveBack {
        let mut leases = self.client.lease_client();
        let revoke = leases.revoke(contender.lease);
        let limit = self.config.command_timeout;
        ttl::give_back_call("etcd lease revoke", limit, revoke, lease_not_found).await
    }
}

/// Range options for the oldest contender of a queue.
fn oldest() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1)
        .with_keys_only()
}

/// The first key of the range read by operation `index` of a transaction, with its
/// create revision.
fn first_key(answer: &TxnResponse, index: usize) -> Option<(Vec<u8>, i64)> {
    match answer.op_responses().into_iter().nth(index)? {
        TxnOpResponse::Get(found) => found
            .kvs()
            .first()
            .map(|kv| (kv.key().to_vec(), kv.create_revision())),
        _ => None,
    }
}

/// One keep-alive on the stream in `slot` (opened if there is none): whether the
/// lease is still alive at etcd.
async fn renew_on(
    slot: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    mut leases: LeaseClient,
    lease: i64,
) -> Result<bool, etcd_client::Error> {
    if let Some((keeper, stream)) = slot.as_mut() {
        keeper.keep_alive().await?;
        return match stream.message().await? {
            Some(answer) => Ok(answer.ttl() > 0),
            None => Err(etcd_client::Error::LeaseKeepAliveError(
                "keep-alive stream ended".to_owned(),
            )),
        };
    }
    // Opening the stream sends the first keep-alive and reads its answer; it fails
    // with "lease not found" if the lease is gone.
    *slot = Some(leases.keep_alive(lease).await?);
    Ok(true)
}

impl TtlBackend for Inner {
    type Target = Arc<Contender>;

    fn timing(&self) -> Timing {
        self.config.timing()
    }

    /// A keep-alive, whatever `ttl` says: etcd renews a lease to the TTL it was
    /// granted with, which is at least the configured lease.
    async fn renew(
        &self,
        contender: &Arc<Contender>,
        _token: &str,
        _ttl: Duration,
        _sent: Instant,
        limit: Instant,
    ) -> Renewal {
        self.keep_alive(contender, limit).await
    }

    /// The watch on the holder's own key saw it deleted: by hand, or with its lease
    /// (revoked, expired, or revoked by a stale leader). The next waiter may hold the
    /// key already.
    async fn gone(&self, contender: &Arc<Contender>) {
        contender.deletion().await;
    }

    async fn try_give_back(&self, contender: &Arc<Contender>, _token: &str) -> GiveBack {
        self.revoke(contender).await
    }

    fn engine(&self) -> &'static str {
        "etcd"
    }

    /// From the last keep-alive on, the lease (and the key) live one lease at most.
    fn give_back_until(&self, sent_at: Instant) -> Instant {
        sent_at + self.config.lease
    }

    /// At once: etcd refuses to attach a key to a revoked or expired lease, so once
    /// the lease is found gone, nothing of this contender can come back.
    fn settles_at(&self, sent_at: Instant, _answered_at: Instant) -> Instant {
        sent_at
    }
}
