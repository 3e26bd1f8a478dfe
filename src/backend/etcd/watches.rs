//! Every watch of a backend on one stream: a holder's watch on its own key (it learns
//! that the key was deleted, by hand or with its lease: revoked, expired, or revoked by
//! a stale leader, as soon as its member applies the deletion) and a waiter's watch on
//! its predecessor's key (it looks at the queue again once that key is gone). Opening
//! and closing a stream, with a task to read it, for each lock and each wait cost the
//! backend a quarter of its throughput at 32 tasks.
//!
//! Each watch has an id of its own on the stream, given by this side (etcd 3.4 and
//! newer). A holder's starts at the revision after its grant: made late, it still sees
//! a deletion made before. A waiter's starts when etcd makes it, which the waiter is
//! told of before it looks at the queue again: a watch from a past revision is one
//! etcd catches up on only every 100 ms, and a hand-off waited for it. A deletion ends
//! the watch (a cancel on the stream), as does a waiter that stops waiting. A stream
//! that breaks sends every waiter to look again, and is opened again with every
//! holder's watch from its revision. A holder's watch that etcd cancels (its history
//! compacted) becomes a look at the key, then a watch from the revision of that look.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchFilterType, WatchOptions, WatchStream};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;
use tokio::time::{sleep_until, timeout, Instant};

use super::lease::Contender;
use crate::backend::ttl::Backoff;

/// The first pause before a stream that failed to open is tried again (growing to the
/// command timeout).
const REOPEN_PAUSE: Duration = Duration::from_millis(50);

/// The revision a waiter's watch starts from: the current one when etcd makes it.
const NOW: i64 = 0;

/// A key to watch for its deletion after revision `from` ([`NOW`]: from when etcd
/// makes the watch), and who is told.
struct Watched {
    key: Vec<u8>,
    from: i64,
    told: Told,
}

enum Told {
    /// A holder, watching its own key: the lease is lost once the key is gone.
    Holder(Weak<Contender>),
    /// A waiter, watching its predecessor's key from when the watch was made: told
    /// once etcd has made it (`created`), and when the key is gone, or the watch is,
    /// so it looks at the queue again (`deleted`).
    Waiter {
        created: Option<oneshot::Sender<()>>,
        deleted: oneshot::Sender<()>,
    },
}

enum Command {
    Watch(i64, Watched),
    /// The waiter stopped waiting.
    Forget(i64),
}

/// A backend's watches; cheap to keep when nothing is watched (no task, no stream).
pub(super) struct Watches {
    client: Client,
    command_timeout: Duration,
    /// Ids of watches, unique on the stream.
    next_id: Arc<AtomicI64>,
    /// The task that owns the stream, fed by this channel; started by the first watch,
    /// and again if its runtime went away.
    task: Mutex<Option<UnboundedSender<Command>>>,
}

/// A waiter's watch on its predecessor's key; forgotten when dropped.
pub(super) struct Deletion {
    id: i64,
    created: oneshot::Receiver<()>,
    /// `None` once told: a oneshot is not awaited again after it answered.
    deleted: Option<oneshot::Receiver<()>>,
    commands: UnboundedSender<Command>,
}

impl Deletion {
    /// Whether etcd made the watch: from then on it sends the key's deletion at once.
    /// Asked once.
    pub(super) async fn created(&mut self) -> bool {
        (&mut self.created).await.is_ok()
    }

    /// Resolves once the key is deleted, or when the waiter must look again without
    /// the watch (etcd cancelled it, the stream broke, or the backend is going away);
    /// at once after that.
    pub(super) async fn seen(&mut self) {
        if let Some(deleted) = self.deleted.as_mut() {
            let _ = deleted.await;
            self.deleted = None;
        }
    }
}

impl Drop for Deletion {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Forget(self.id));
    }
}

impl Watches {
    pub(super) fn new(client: Client, command_timeout: Duration) -> Self {
        Self {
            client,
            command_timeout,
            next_id: Arc::new(AtomicI64::new(1)),
            task: Mutex::new(None),
        }
    }

    /// Watches the holder's own key, created at revision `place`, until it is deleted.
    pub(super) fn holder(&self, contender: &Arc<Contender>, place: i64) {
        let told = Told::Holder(Arc::downgrade(contender));
        self.watch(contender.key.as_bytes().to_vec(), place, told);
    }

    /// Watches `key` for its deletion from when etcd makes the watch on, for a
    /// waiter. A watch from an earlier revision would be one etcd catches up on only
    /// every 100 ms, late by that much; the waiter looks at the queue again once the
    /// watch is made instead, so no deletion slips between.
    pub(super) fn waiter(&self, key: Vec<u8>) -> Deletion {
        let (created_sender, created) = oneshot::channel();
        let (deleted_sender, deleted) = oneshot::channel();
        let told = Told::Waiter {
            created: Some(created_sender),
            deleted: deleted_sender,
        };
        let (id, commands) = self.watch(key, NOW, told);
        Deletion {
            id,
            created,
            deleted: Some(deleted),
            commands,
        }
    }

    fn watch(&self, key: Vec<u8>, from: i64, told: Told) -> (i64, UnboundedSender<Command>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut command = Command::Watch(id, Watched { key, from, told });
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = task.as_ref() {
            match sender.send(command) {
                Ok(()) => return (id, sender.clone()),
                Err(mpsc::error::SendError(back)) => command = back,
            }
        }
        let (sender, commands) = mpsc::unbounded_channel();
        let _ = sender.send(command);
        let next_id = self.next_id.clone();
        tokio::spawn(run(
            self.client.clone(),
            self.command_timeout,
            next_id,
            commands,
        ));
        *task = Some(sender.clone());
        (id, sender)
    }
}

/// The stream's owner: opens it when a key is to be watched, sends each watch, tells
/// each deletion. Ends when the backend is gone (the channel closed).
async fn run(
    client: Client,
    command_timeout: Duration,
    next_id: Arc<AtomicI64>,
    mut commands: UnboundedReceiver<Command>,
) {
    let mut watched: HashMap<i64, Watched> = HashMap::new();
    let mut stream: Option<WatchStream> = None;
    let mut backoff = Backoff::new(REOPEN_PAUSE, command_timeout.max(REOPEN_PAUSE));
    let mut reopen_at: Option<Instant> = None;
    loop {
        if stream.is_none()
            && !watched.is_empty()
            && reopen_at.is_none_or(|at| Instant::now() >= at)
        {
            match open(&client, &watched, command_timeout).await {
                Some(opened) => {
                    stream = Some(opened);
                    reopen_at = None;
                    backoff = Backoff::new(REOPEN_PAUSE, command_timeout.max(REOPEN_PAUSE));
                }
                None => reopen_at = Some(Instant::now() + backoff.pause()),
            }
        }
        let reopen = reopen_at.filter(|_| stream.is_none());
        let message = async {
            match stream.as_mut() {
                Some(stream) => stream.message().await,
                None => std::future::pending().await,
            }
        };
        // What the stream is to be sent, once the select is over: a watch or a cancel.
        let mut send: Option<(i64, bool)> = None;
        tokio::select! {
            command = commands.recv() => match command {
                None => return,
                Some(Command::Watch(id, new)) => {
                    watched.insert(id, new);
                    send = Some((id, true));
                }
                Some(Command::Forget(id)) => {
                    if watched.remove(&id).is_some() {
                        send = Some((id, false));
                    }
                }
            },
            message = message => match message {
                Ok(Some(response)) => {
                    let id = response.watch_id();
                    if response.created() {
                        if let Some(Watched { told: Told::Waiter { created, .. }, .. }) = watched.get_mut(&id) {
                            if let Some(created) = created.take() {
                                let _ = created.send(());
                            }
                        }
                    }
                    if response.canceled() {
                        // Compacted past its revision (or refused).
                        if let Some(old) = watched.remove(&id) {
                            match look_again(&client, old, command_timeout).await {
                                Looked::Done => {}
                                Looked::Watch(still) => {
                                    let id = next_id.fetch_add(1, Ordering::Relaxed);
                                    watched.insert(id, still);
                                    send = Some((id, true));
                                }
                                // Watched again with the stream, after a pause.
                                Looked::Failed(kept) => {
                                    watched.insert(id, kept);
                                    stream = None;
                                    reopen_at = Some(Instant::now() + backoff.pause());
                                }
                            }
                        }
                    } else if response
                        .events()
                        .iter()
                        .any(|event| event.event_type() == EventType::Delete)
                    {
                        if let Some(gone) = watched.remove(&id) {
                            tell(gone.told);
                        }
                        send = Some((id, false));
                    }
                }
                // Broken or ended: the waiters look again; the holders' watches are
                // made again, each from its revision.
                Ok(None) | Err(_) => {
                    watched.retain(|_, watch| match &watch.told {
                        Told::Holder(_) => true,
                        Told::Waiter { .. } => false,
                    });
                    stream = None;
                    reopen_at = Some(Instant::now() + backoff.pause());
                }
            },
            // The pause is over: the top of the loop opens the stream.
            () = sleep_until(reopen.unwrap_or_else(Instant::now)), if reopen.is_some() => {}
        }
        if let (Some((id, create)), Some(open)) = (send, stream.as_mut()) {
            let sent = match (create, watched.get(&id)) {
                (true, Some(new)) => {
                    timeout(
                        command_timeout,
                        open.watch(new.key.clone(), Some(options(id, new))),
                    )
                    .await
                }
                (true, None) => Ok(Ok(())),
                (false, _) => timeout(command_timeout, open.cancel(id)).await,
            };
            if !matches!(sent, Ok(Ok(()))) {
                stream = None;
            }
        }
    }
}

fn tell(told: Told) {
    match told {
        Told::Holder(contender) => {
            if let Some(contender) = contender.upgrade() {
                contender.mark_deleted();
            }
        }
        Told::Waiter { deleted, .. } => {
            let _ = deleted.send(());
        }
    }
}

/// The options of watch `id` on `watched`'s key: its deletions after its revision.
fn options(id: i64, watched: &Watched) -> WatchOptions {
    let options = WatchOptions::new()
        .with_filters([WatchFilterType::NoPut])
        .with_watch_id(id);
    match watched.from {
        NOW => options,
        from => options.with_start_revision(from + 1),
    }
}

/// A stream with a watch for each of `watched`; `None` if it could not be opened.
async fn open(
    client: &Client,
    watched: &HashMap<i64, Watched>,
    command_timeout: Duration,
) -> Option<WatchStream> {
    let mut each = watched.iter();
    let (&id, first) = each.next()?;
    let mut watches = client.watch_client();
    let opened = timeout(
        command_timeout,
        watches.watch(first.key.clone(), Some(options(id, first))),
    );
    let Ok(Ok(mut stream)) = opened.await else {
        tracing::debug!("etcd watch stream failed to open; trying again");
        return None;
    };
    for (&id, watched) in each {
        let sent = stream.watch(watched.key.clone(), Some(options(id, watched)));
        if !matches!(timeout(command_timeout, sent).await, Ok(Ok(()))) {
            return None;
        }
    }
    Some(stream)
}

/// What a look at a key whose watch etcd cancelled came to.
enum Looked {
    /// The waiter told to look itself; or the holder's key deleted (the holder told),
    /// or the holder gone: nothing more to watch.
    Done,
    /// The holder's key is there: to be watched from the look's revision.
    Watch(Watched),
    /// No answer: to be watched again from its revision, after a pause.
    Failed(Watched),
}

async fn look_again(client: &Client, mut watched: Watched, limit: Duration) -> Looked {
    let contender = match &watched.told {
        Told::Waiter { .. } => {
            tell(watched.told);
            return Looked::Done;
        }
        Told::Holder(contender) => match contender.upgrade() {
            Some(contender) => contender,
            None => return Looked::Done,
        },
    };
    let mut kv = client.kv_client();
    let found = kv.get(
        watched.key.clone(),
        Some(GetOptions::new().with_keys_only()),
    );
    let Ok(Ok(found)) = timeout(limit, found).await else {
        return Looked::Failed(watched);
    };
    if found.kvs().is_empty() {
        contender.mark_deleted();
        return Looked::Done;
    }
    if let Some(header) = found.header() {
        watched.from = watched.from.max(header.revision());
    }
    Looked::Watch(watched)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiter sent to look again may find the same predecessor and wait again: the
    /// watch it already saw answers at once (awaiting its oneshot again panicked).
    #[tokio::test]
    async fn a_deletion_seen_answers_again_at_once() {
        let (_created, created) = oneshot::channel();
        let (deleted_sender, deleted) = oneshot::channel();
        let (commands, _hub) = mpsc::unbounded_channel();
        let mut deletion = Deletion {
            id: 1,
            created,
            deleted: Some(deleted),
            commands,
        };
        drop(deleted_sender);
        deletion.seen().await;
        deletion.seen().await;
    }
}
