//! An in-memory [`LockBackend`] with the whole contract of a distributed engine, for
//! testing an application's own reaction to a lost lease without a server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;
use tokio::time::{sleep_until, Instant};

use crate::backend::{
    default_instance_id, Acquisition, BoxFuture, Holder, Lease, LeaseLostSender, LeaseSignal,
    LockMode, LostReason, ReleaseLease,
};
use crate::{Key, LockBackend, LockError};

/// The lease of a [`MemoryBackend`] unless [`MemoryBackend::with_lease`] says otherwise.
pub const DEFAULT_MEMORY_LEASE: Duration = Duration::from_secs(1);

/// An in-memory lock engine and one instance's backend on it: clones share the engine,
/// as instances share a server. It keeps the contract of the crate's engines: exclusive,
/// shared and permit holders (a waiting writer stops new shared and permit holders),
/// fencing tokens that only go up (a reader's is the last writer's), who holds a key,
/// leases renewed every third of the lease by a task of the holder's runtime (a holder
/// whose runtime stalls or ends loses the key a lease later), and waiters woken by a
/// release. [`lose`](Self::lose) takes a key from its holders as an engine would
/// (their signals raised, [`LostReason::NotOwner`]): the hook for testing what an
/// application does with a lost lease. The conformance suite runs it like any engine.
///
/// ```
/// use tower_keyed_lock::testkit::MemoryBackend;
/// use tower_keyed_lock::DistributedLocks;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let engine = MemoryBackend::new();
/// let jobs = DistributedLocks::new("jobs", engine.clone());
/// let guard = jobs.lock("nightly").await.unwrap();
/// assert!(engine.lose("jobs", "nightly"));
/// assert!(guard.is_lost());
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct MemoryBackend {
    engine: Arc<Engine>,
    lease: Duration,
}

#[derive(Debug, Default)]
struct Engine {
    state: Mutex<State>,
    /// Woken by every change that may let a waiter in.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<(String, String), KeyState>,
    /// The last fencing token of an exclusive or permit grant, on any key: tokens go
    /// up for every key with no record kept per key released.
    fence: u64,
    next_owner: u64,
}

#[derive(Debug, Default)]
struct KeyState {
    holders: Vec<Held>,
    /// Exclusive acquisitions waiting now: no new shared or permit holder enters.
    waiting_writers: usize,
}

#[derive(Debug)]
struct Held {
    owner: u64,
    mode: LockMode,
    expires: Instant,
    fence: u64,
    since: SystemTime,
    lost: LeaseLostSender,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// A new engine, with leases of [`DEFAULT_MEMORY_LEASE`].
    pub fn new() -> Self {
        Self {
            engine: Arc::default(),
            lease: DEFAULT_MEMORY_LEASE,
        }
    }

    /// This backend with leases of `lease` (at least 3 ms: renewal runs every third),
    /// on the same engine.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(3));
        self
    }

    /// Takes `key` of the lock `name` from every holder, as an engine that lost or
    /// reassigned it would: each holder's signal is raised with
    /// [`LostReason::NotOwner`] and the key is free. Whether anyone held it.
    pub fn lose(&self, name: &str, key: &str) -> bool {
        let mut state = self.engine.lock();
        let Some(entry) = state.keys.remove(&(name.to_owned(), key.to_owned())) else {
            return false;
        };
        let held = !entry.holders.is_empty();
        for holder in entry.holders {
            holder.lost.lose(LostReason::NotOwner);
        }
        if entry.waiting_writers > 0 {
            // Waiters keep their count: the entry comes back empty with them.
            state
                .keys
                .entry((name.to_owned(), key.to_owned()))
                .or_default()
                .waiting_writers = entry.waiting_writers;
        }
        drop(state);
        self.engine.changed.notify_waiters();
        held
    }

    /// The keys of lock `name` with a record now: held, or waited for by a writer.
    pub fn records(&self, name: &str) -> usize {
        let state = self.engine.lock();
        state.keys.keys().filter(|(n, _)| n == name).count()
    }

    async fn acquire_in(
        self,
        id: (String, String),
        mode: LockMode,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let deadline = Instant::now() + wait;
        let mut waiting: Option<WaitingWriter> = None;
        // Whether a look found the key held: the grant after it was contended.
        let mut contended = false;
        loop {
            let changed = self.engine.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let next_expiry = {
                let mut state = self.engine.lock();
                let now = Instant::now();
                let entry = state.keys.entry(id.clone()).or_default();
                entry.prune(now);
                if entry.admits(mode) {
                    let lease = self.grant(&mut state, &id, mode, now);
                    drop(state);
                    drop(waiting);
                    return Ok(lease.with_contention(contended));
                }
                contended = true;
                let entry = state.keys.entry(id.clone()).or_default();
                if mode == LockMode::Exclusive && waiting.is_none() && now < deadline {
                    entry.waiting_writers += 1;
                    waiting = Some(WaitingWriter {
                        engine: self.engine.clone(),
                        id: id.clone(),
                    });
                }
                entry.holders.iter().map(|held| held.expires).min()
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout);
            }
            let until = next_expiry.map_or(deadline, |expiry| expiry.min(deadline));
            tokio::select! {
                () = changed => {}
                () = sleep_until(until) => {}
            }
        }
    }

    /// Grants `id` in `mode` to a new owner: its lease, renewed by a task of this
    /// runtime.
    fn grant(
        &self,
        state: &mut State,
        id: &(String, String),
        mode: LockMode,
        now: Instant,
    ) -> Lease {
        state.next_owner += 1;
        let owner = state.next_owner;
        if mode != LockMode::Shared {
            state.fence += 1;
        }
        let fence = state.fence;
        let (lost, signal) = LeaseSignal::with_deadline(now + self.lease);
        let held = Held {
            owner,
            mode,
            expires: now + self.lease,
            fence,
            since: SystemTime::now(),
            lost,
        };
        state.keys.entry(id.clone()).or_default().holders.push(held);
        let renewal = tokio::spawn(renew(self.engine.clone(), id.clone(), owner, self.lease));
        let release = Release {
            engine: self.engine.clone(),
            id: id.clone(),
            owner,
            renewal,
        };
        Lease::new(Some(fence), signal, release)
    }
}

impl Engine {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes `owner`'s hold on `id`, and the key's record once nothing is left.
    fn release(&self, id: &(String, String), owner: u64) {
        let mut state = self.lock();
        if let Some(entry) = state.keys.get_mut(id) {
            entry.holders.retain(|held| held.owner != owner);
            if entry.holders.is_empty() && entry.waiting_writers == 0 {
                state.keys.remove(id);
            }
        }
        drop(state);
        self.changed.notify_waiters();
    }
}

impl KeyState {
    /// Drops the holders whose lease ran out; their signals are raised at the deadline.
    fn prune(&mut self, now: Instant) {
        self.holders.retain(|held| {
            let alive = now < held.expires;
            if !alive {
                held.lost.lose_at_deadline();
            }
            alive
        });
    }

    /// Whether a holder in `mode` may enter now.
    fn admits(&self, mode: LockMode) -> bool {
        let exclusive = self.holders.iter().any(|h| h.mode == LockMode::Exclusive);
        match mode {
            LockMode::Exclusive => self.holders.is_empty(),
            LockMode::Shared => !exclusive && self.waiting_writers == 0,
            LockMode::Permit { of } => {
                let permits = self
                    .holders
                    .iter()
                    .filter(|h| matches!(h.mode, LockMode::Permit { .. }))
                    .count();
                !exclusive && self.waiting_writers == 0 && permits < of
            }
        }
    }
}

/// An exclusive acquisition counted as waiting; uncounted when it ends, however.
struct WaitingWriter {
    engine: Arc<Engine>,
    id: (String, String),
}

impl Drop for WaitingWriter {
    fn drop(&mut self) {
        let mut state = self.engine.lock();
        if let Some(entry) = state.keys.get_mut(&self.id) {
            entry.waiting_writers -= 1;
            if entry.holders.is_empty() && entry.waiting_writers == 0 {
                state.keys.remove(&self.id);
            }
        }
        drop(state);
        self.engine.changed.notify_waiters();
    }
}

/// Renews `owner`'s hold every third of `lease` while it is there and unexpired.
async fn renew(engine: Arc<Engine>, id: (String, String), owner: u64, lease: Duration) {
    let mut sent = Instant::now();
    loop {
        sleep_until(sent + lease / 3).await;
        sent = Instant::now();
        let mut state = engine.lock();
        let Some(held) = state
            .keys
            .get_mut(&id)
            .and_then(|entry| entry.holders.iter_mut().find(|h| h.owner == owner))
        else {
            return; // released, or taken
        };
        if sent >= held.expires || !held.lost.extend(sent + lease) {
            held.lost.lose_at_deadline();
            return;
        }
        held.expires = sent + lease;
    }
}

struct Release {
    engine: Arc<Engine>,
    id: (String, String),
    owner: u64,
    renewal: tokio::task::JoinHandle<()>,
}

impl ReleaseLease for Release {
    fn release(self: Box<Self>) -> BoxFuture<()> {
        drop(self);
        Box::pin(async {})
    }
}

impl Drop for Release {
    /// Released or dropped alike: the renewal stops and the hold goes at once.
    fn drop(&mut self) {
        self.renewal.abort();
        self.engine.release(&self.id, self.owner);
    }
}

impl LockBackend for MemoryBackend {
    fn acquire(&self, name: &str, key: &Key, wait: Duration) -> Acquisition {
        self.acquire_mode(name, key, LockMode::Exclusive, wait)
    }

    fn acquire_mode(&self, name: &str, key: &Key, mode: LockMode, wait: Duration) -> Acquisition {
        let id = (name.to_owned(), key.as_str().to_owned());
        Box::pin(self.clone().acquire_in(id, mode, wait))
    }

    fn supports(&self, _mode: LockMode) -> bool {
        true
    }

    fn engine(&self) -> &'static str {
        "memory"
    }

    /// The longest-held live holder of the key.
    fn holder(&self, name: &str, key: &Key) -> BoxFuture<Result<Option<Holder>, LockError>> {
        let state = self.engine.lock();
        let now = Instant::now();
        let holder = state
            .keys
            .get(&(name.to_owned(), key.as_str().to_owned()))
            .and_then(|entry| entry.holders.iter().find(|held| now < held.expires))
            .map(|held| {
                Holder::new()
                    .with_instance(default_instance_id())
                    .with_since(held.since)
                    .with_fencing_token(held.fence)
                    .with_lease_left(held.expires - now)
            });
        Box::pin(async move { Ok(holder) })
    }
}
