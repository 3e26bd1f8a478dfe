//! The holders' own keys, watched on one stream per backend: a holder learns that its
//! key was deleted (by hand, or with its lease: revoked, expired, or revoked by a stale
//! leader) as soon as its member applies the deletion, without a stream and a task of
//! its own per lock (opening and closing one per lock cost a quarter of the backend's
//! throughput at 32 tasks).
//!
//! Each key has a watch of its own on the stream, under an id this side gives (etcd
//! 3.4 and newer), from the revision after the key's grant: a watch made late still
//! sees a deletion made before. The deletion ends the watch (a cancel on the stream).
//! A stream that breaks is opened again with every key still watched, each from its
//! revision; a watch etcd cancels (history compacted past its revision) becomes a look
//! at the key, then a watch from the revision of that look.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchFilterType, WatchOptions, WatchStream};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::time::{sleep_until, timeout, Instant};

use super::lease::Contender;
use crate::backend::ttl::Backoff;

/// The first pause before a stream that failed to open is tried again (growing to the
/// command timeout).
const REOPEN_PAUSE: Duration = Duration::from_millis(50);

/// One holder's key to watch, from the revision after `from`.
struct Watched {
    key: Vec<u8>,
    from: i64,
    contender: Weak<Contender>,
}

/// A backend's watches; cheap to keep when nothing is watched (no task, no stream).
pub(super) struct Watches {
    client: Client,
    command_timeout: Duration,
    /// The task that owns the stream, fed by this channel; started by the first watch,
    /// and again if its runtime went away.
    task: Mutex<Option<UnboundedSender<Watched>>>,
}

impl Watches {
    pub(super) fn new(client: Client, command_timeout: Duration) -> Self {
        Self {
            client,
            command_timeout,
            task: Mutex::new(None),
        }
    }

    /// Watches the holder's own key, created at revision `place`, until it is deleted.
    pub(super) fn watch(&self, contender: &Arc<Contender>, place: i64) {
        let mut watched = Watched {
            key: contender.key.as_bytes().to_vec(),
            from: place,
            contender: Arc::downgrade(contender),
        };
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = task.as_ref() {
            match sender.send(watched) {
                Ok(()) => return,
                Err(mpsc::error::SendError(back)) => watched = back,
            }
        }
        let (sender, commands) = mpsc::unbounded_channel();
        sender.send(watched).expect("the receiver is here");
        tokio::spawn(run(self.client.clone(), self.command_timeout, commands));
        *task = Some(sender);
    }
}

/// The stream's owner: opens it when a key is to be watched, sends each watch, routes
/// each deletion to its holder. Ends when the backend is gone (the channel closed).
async fn run(client: Client, command_timeout: Duration, mut commands: UnboundedReceiver<Watched>) {
    let mut watched: HashMap<i64, Watched> = HashMap::new();
    let mut next_id: i64 = 1;
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
        tokio::select! {
            command = commands.recv() => {
                let Some(new) = command else { return };
                let id = next_id;
                next_id += 1;
                if let Some(open) = stream.as_mut() {
                    if !create(open, id, &new, command_timeout).await {
                        stream = None;
                    }
                }
                watched.insert(id, new);
            }
            message = message => match message {
                Ok(Some(response)) => {
                    let id = response.watch_id();
                    if response.canceled() {
                        // Compacted past its revision (or refused): look, then again.
                        if let Some(old) = watched.remove(&id) {
                            match look(&client, old, command_timeout).await {
                                Looked::Deleted => {}
                                Looked::There(still) => {
                                    let id = next_id;
                                    next_id += 1;
                                    if let Some(open) = stream.as_mut() {
                                        if !create(open, id, &still, command_timeout).await {
                                            stream = None;
                                        }
                                    }
                                    watched.insert(id, still);
                                }
                                // Watched again with the stream, after a pause.
                                Looked::Failed(kept) => {
                                    watched.insert(next_id, kept);
                                    next_id += 1;
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
                            if let Some(contender) = gone.contender.upgrade() {
                                contender.mark_deleted();
                            }
                        }
                        if let Some(open) = stream.as_mut() {
                            if timeout(command_timeout, open.cancel(id)).await.is_err() {
                                stream = None;
                            }
                        }
                    }
                }
                // Broken or ended: open again, every key from its revision.
                Ok(None) | Err(_) => {
                    stream = None;
                    reopen_at = Some(Instant::now() + backoff.pause());
                }
            },
            // The pause is over: the top of the loop opens the stream.
            () = sleep_until(reopen.unwrap_or_else(Instant::now)), if reopen.is_some() => {}
        }
    }
}

/// The options of watch `id` on `watched`'s key: its deletions after its revision.
fn options(id: i64, watched: &Watched) -> WatchOptions {
    WatchOptions::new()
        .with_start_revision(watched.from + 1)
        .with_filters([WatchFilterType::NoPut])
        .with_watch_id(id)
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
        if !create(&mut stream, id, watched, command_timeout).await {
            return None;
        }
    }
    Some(stream)
}

/// Sends watch `id` on the stream; false if the stream is broken.
async fn create(stream: &mut WatchStream, id: i64, watched: &Watched, limit: Duration) -> bool {
    let sent = stream.watch(watched.key.clone(), Some(options(id, watched)));
    matches!(timeout(limit, sent).await, Ok(Ok(())))
}

/// What a look at a key whose watch etcd cancelled found.
enum Looked {
    /// Deleted (its holder told), or its holder gone: nothing more to watch.
    Deleted,
    /// There: to be watched from the look's revision.
    There(Watched),
    /// No answer: to be watched again from its revision, after a pause.
    Failed(Watched),
}

async fn look(client: &Client, mut watched: Watched, limit: Duration) -> Looked {
    let Some(contender) = watched.contender.upgrade() else {
        return Looked::Deleted;
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
        return Looked::Deleted;
    }
    if let Some(header) = found.header() {
        watched.from = watched.from.max(header.revision());
    }
    Looked::There(watched)
}
