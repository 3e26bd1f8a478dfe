//! [`FaultProxy`], a loopback TCP proxy that injects network faults between an instance
//! and its server: what the fault checks put in an instance's path.
//!
//! Modes, switchable at any time while connections are open:
//! - `Forward`: bytes pass through (each `delay` after it was read, if set);
//! - `Blackhole`: bytes are read and dropped in both directions, nothing is closed, and
//!   a side that closes is not told to the other — a path that went silent without a
//!   reset (a partition, a dead NAT entry);
//! - `reset()`: every open connection is closed at once with RST (SO_LINGER 0);
//! - `blackhole_existing()`: the connections open now go silent for good, new ones
//!   forward — a client stuck on a dead path that a fresh connection would avoid.
//! - `hold_existing()` … `release_held()`: what the clients of the connections open now
//!   send is kept, then delivered in order, even if the client has closed meanwhile —
//!   a path that delays rather than drops (TCP retransmits what the kernel still has).
//!
//! New connections are accepted in every mode; in `Blackhole` they stay silent too.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// What the proxy does with the bytes it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Forward,
    Blackhole,
}

#[derive(Clone, Copy, Debug)]
struct Settings {
    mode: Mode,
    delay: Duration,
    /// Bumped by `reset()`: every connection opened before it closes with RST.
    generation: u64,
    /// Connections numbered below this are silent whatever the mode.
    silent_below: u64,
    /// Connections numbered below this keep what their client sends, until released.
    held_below: u64,
}

/// A running proxy between clients on 127.0.0.1 and one server; it stops (and closes
/// every connection) when dropped. Give an instance [`host_port`](Self::host_port)
/// instead of the server's address, then break its path while it runs.
///
/// ```no_run
/// # async fn run(server: std::net::SocketAddr) {
/// use tower_keyed_lock::testkit::FaultProxy;
///
/// let proxy = FaultProxy::start(server).await;
/// // … an instance connects to proxy.host_port() …
/// proxy.blackhole(); // its path goes silent, nothing is closed
/// proxy.heal();
/// proxy.reset(); // every connection closed with a reset
/// # }
/// ```
pub struct FaultProxy {
    /// Where the proxy listens: 127.0.0.1 and a free port.
    pub addr: SocketAddr,
    settings: watch::Sender<Settings>,
    connections: Arc<Mutex<usize>>,
    /// Connections accepted so far; the next one gets this number.
    accepted: Arc<AtomicU64>,
    delivered_late: Arc<AtomicU64>,
    /// Round trips over every connection: a client's bytes after the server's.
    round_trips: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream`, on the current
    /// tokio runtime.
    ///
    /// # Panics
    /// If no port of 127.0.0.1 can be bound.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (settings, watcher) = watch::channel(Settings {
            mode: Mode::Forward,
            delay: Duration::ZERO,
            generation: 0,
            silent_below: 0,
            held_below: 0,
        });
        let connections = Arc::new(Mutex::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let open = connections.clone();
        let numbering = accepted.clone();
        let delivered_late = Arc::new(AtomicU64::new(0));
        let late = delivered_late.clone();
        let round_trips = Arc::new(AtomicU64::new(0));
        let counted = round_trips.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let number = numbering.fetch_add(1, Ordering::SeqCst);
                let watcher = watcher.clone();
                let open = open.clone();
                let late = late.clone();
                let turns = Turns {
                    server_spoke: Arc::new(AtomicBool::new(true)),
                    count: counted.clone(),
                };
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    *open
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
                    pipe(client, server, number, watcher, (late, turns)).await;
                    *open
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner) -= 1;
                });
            }
        });
        FaultProxy {
            addr,
            settings,
            connections,
            accepted,
            delivered_late,
            round_trips,
            accept,
        }
    }

    /// Round trips made through the proxy so far, over every connection: each time a
    /// client sent bytes after the server had sent some (or first). A pipelined batch
    /// is one; so is a request that the network split.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::SeqCst)
    }

    /// `host:port` of the proxy, for connection strings.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Drops every byte from now on, without closing anything.
    pub fn blackhole(&self) {
        self.settings.send_modify(|s| s.mode = Mode::Blackhole);
    }

    /// Silences every connection open now, for good and without closing it; later
    /// connections forward as usual.
    pub fn blackhole_existing(&self) {
        let next = self.accepted.load(Ordering::SeqCst);
        self.settings.send_modify(|s| s.silent_below = next);
    }

    /// Keeps what the clients of the connections open now send, without closing
    /// anything (a path that delays rather than drops); later connections forward as
    /// usual.
    pub fn hold_existing(&self) {
        let next = self.accepted.load(Ordering::SeqCst);
        self.settings.send_modify(|s| s.held_below = next);
    }

    /// Delivers what [`hold_existing`](Self::hold_existing) kept, in order, and
    /// forwards again.
    pub fn release_held(&self) {
        self.settings.send_modify(|s| s.held_below = 0);
    }

    /// Bytes kept by [`hold_existing`](Self::hold_existing) and delivered since
    /// (counted as they are written).
    pub fn delivered_late(&self) -> u64 {
        self.delivered_late.load(Ordering::SeqCst)
    }

    /// Forwards again (after a blackhole), with the current delay.
    pub fn heal(&self) {
        self.settings.send_modify(|s| s.mode = Mode::Forward);
    }

    /// Delivers every chunk `delay` after it was read (latency: the chunks behind it
    /// are not held up by more than that).
    pub fn delay(&self, delay: Duration) {
        self.settings.send_modify(|s| s.delay = delay);
    }

    /// Closes every open connection with a reset; new ones are accepted as before.
    pub fn reset(&self) {
        self.settings.send_modify(|s| s.generation += 1);
    }

    /// Connections open through the proxy now.
    pub fn open_connections(&self) -> usize {
        *self
            .connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset();
    }
}

/// Who spoke last on one connection, and the proxy's count of round trips.
#[derive(Clone)]
struct Turns {
    server_spoke: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
}

impl Turns {
    /// Bytes went through toward the server (`up`) or the client.
    fn passed(&self, up: bool) {
        match up {
            true if self.server_spoke.swap(false, Ordering::SeqCst) => {
                self.count.fetch_add(1, Ordering::SeqCst);
            }
            true => {}
            false => self.server_spoke.store(true, Ordering::SeqCst),
        }
    }
}

/// Copies both directions until either side closes or a reset is asked for.
async fn pipe(
    client: TcpStream,
    server: TcpStream,
    number: u64,
    mut watcher: watch::Receiver<Settings>,
    (delivered_late, turns): (Arc<AtomicU64>, Turns),
) {
    let generation = watcher.borrow().generation;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = copy(
        &mut client_read,
        &mut server_write,
        (number, turns.clone()),
        watcher.clone(),
        Some(delivered_late),
    );
    let down = copy(
        &mut server_read,
        &mut client_write,
        (number, turns),
        watcher.clone(),
        None,
    );
    let reset = watcher.wait_for(|s| s.generation != generation);
    let was_reset = tokio::select! {
        _ = async { tokio::join!(up, down) } => false,
        _ = reset => true,
    };
    if was_reset {
        // Reunited (a write half shuts down with FIN when dropped) and closed with
        // linger 0, each socket sends RST.
        for stream in [
            client_read.reunite(client_write),
            server_read.reunite(server_write),
        ]
        .into_iter()
        .flatten()
        {
            #[allow(deprecated)]
            let _ = stream.set_linger(Some(Duration::ZERO));
        }
    }
}

/// A chunk read from one side, on its way to the other.
struct Chunk {
    /// When it reaches the other side: read time plus the delay then set.
    due: Instant,
    bytes: Vec<u8>,
    /// Kept while held, delivered on release.
    late: bool,
}

/// Copies `from` to `to` per the current settings, until `from` ends (and what it
/// sent while held is delivered) or a write fails. `held` counts the late deliveries
/// of the direction that can be held (client to server); `None` for the other.
///
/// A delay is latency, not a queue: each chunk is due its delay after it was read,
/// while later chunks are read and go on their way meanwhile, as on a long link. (One
/// chunk at a time would add up the delay of every frame of a multiplexed connection.)
async fn copy(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    (number, turns): (u64, Turns),
    settings: watch::Receiver<Settings>,
    held: Option<Arc<AtomicU64>>,
) {
    let silent = move |s: &Settings| s.mode == Mode::Blackhole || number < s.silent_below;
    let (queue, mut on_the_way) = mpsc::unbounded_channel::<Chunk>();
    let read = read_chunks(
        from,
        queue,
        (number, silent),
        settings.clone(),
        held.is_some(),
    );
    let write = async {
        while let Some(chunk) = on_the_way.recv().await {
            tokio::time::sleep_until(chunk.due).await;
            // A blackhole that began while the chunk was on its way swallows it too.
            if silent(&settings.borrow()) {
                continue;
            }
            if to.write_all(&chunk.bytes).await.is_err() {
                // Dropping the queue's receiver stops the reading side.
                return;
            }
            turns.passed(held.is_some());
            if let (true, Some(held)) = (chunk.late, &held) {
                held.fetch_add(chunk.bytes.len() as u64, Ordering::SeqCst);
            }
        }
        // A partition swallows the FIN too: the other side hears nothing.
        if settings.borrow().mode == Mode::Blackhole {
            return;
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

/// Reads `from` into `queue` per the current settings, until `from` ends (and what it
/// sent while held is queued) or the queue's writing side has stopped.
async fn read_chunks(
    from: &mut OwnedReadHalf,
    queue: mpsc::UnboundedSender<Chunk>,
    (number, silent): (u64, impl Fn(&Settings) -> bool),
    mut settings: watch::Receiver<Settings>,
    can_hold: bool,
) {
    let holding = |s: &Settings| can_hold && number < s.held_below;
    let mut buffer = vec![0u8; 16 * 1024];
    // What the client sent while held, in order.
    let mut kept: Vec<u8> = Vec::new();
    let mut open = true;
    loop {
        let read = if kept.is_empty() {
            if !open {
                return;
            }
            tokio::select! {
                read = from.read(&mut buffer) => read,
                () = queue.closed() => return,
            }
        } else {
            let released = async {
                let _ = settings.wait_for(|s| !holding(s)).await;
            };
            tokio::select! {
                read = from.read(&mut buffer), if open => read,
                () = released => {
                    let bytes = std::mem::take(&mut kept);
                    let late = Chunk { due: Instant::now(), bytes, late: true };
                    if queue.send(late).is_err() {
                        return;
                    }
                    continue;
                }
                () = queue.closed() => return,
            }
        };
        let n = match read {
            Ok(0) | Err(_) => {
                open = false;
                continue;
            }
            Ok(n) => n,
        };
        let now = *settings.borrow();
        if silent(&now) {
            continue;
        }
        if holding(&now) || !kept.is_empty() {
            kept.extend_from_slice(&buffer[..n]);
            continue;
        }
        let chunk = Chunk {
            due: Instant::now() + now.delay,
            bytes: buffer[..n].to_vec(),
            late: false,
        };
        if queue.send(chunk).is_err() {
            return;
        }
    }
}
