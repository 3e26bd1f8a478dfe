//! A loopback TCP proxy that injects network faults between an instance and its server.
//!
//! Modes, switchable at any time while connections are open:
//! - `Forward`: bytes pass through (after `delay`, if set);
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with the bytes it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
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

/// A running proxy; it stops (and closes every connection) when dropped.
pub struct TcpProxy {
    pub addr: SocketAddr,
    settings: watch::Sender<Settings>,
    connections: Arc<Mutex<usize>>,
    /// Connections accepted so far; the next one gets this number.
    accepted: Arc<AtomicU64>,
    delivered_late: Arc<AtomicU64>,
    accept: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
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
        let accept = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let number = numbering.fetch_add(1, Ordering::SeqCst);
                let watcher = watcher.clone();
                let open = open.clone();
                let late = late.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    *open.lock().unwrap() += 1;
                    pipe(client, server, number, watcher, late).await;
                    *open.lock().unwrap() -= 1;
                });
            }
        });
        TcpProxy {
            addr,
            settings,
            connections,
            accepted,
            delivered_late,
            accept,
        }
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
    /// anything; later connections forward as usual.
    pub fn hold_existing(&self) {
        let next = self.accepted.load(Ordering::SeqCst);
        self.settings.send_modify(|s| s.held_below = next);
    }

    /// Delivers what `hold_existing` kept, in order, and forwards again.
    pub fn release_held(&self) {
        self.settings.send_modify(|s| s.held_below = 0);
    }

    /// Bytes kept by `hold_existing` and delivered since (counted as they are written).
    pub fn delivered_late(&self) -> u64 {
        self.delivered_late.load(Ordering::SeqCst)
    }

    /// Forwards again (after a blackhole), with the current delay.
    pub fn heal(&self) {
        self.settings.send_modify(|s| s.mode = Mode::Forward);
    }

    /// Holds every chunk for `delay` before forwarding it.
    pub fn delay(&self, delay: Duration) {
        self.settings.send_modify(|s| s.delay = delay);
    }

    /// Closes every open connection with a reset; new ones are accepted as before.
    pub fn reset(&self) {
        self.settings.send_modify(|s| s.generation += 1);
    }

    /// Connections open through the proxy now.
    pub fn open_connections(&self) -> usize {
        *self.connections.lock().unwrap()
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset();
    }
}

/// Copies both directions until either side closes or a reset is asked for.
async fn pipe(
    client: TcpStream,
    server: TcpStream,
    number: u64,
    mut watcher: watch::Receiver<Settings>,
    delivered_late: Arc<AtomicU64>,
) {
    let generation = watcher.borrow().generation;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up = copy(
        &mut client_read,
        &mut server_write,
        number,
        watcher.clone(),
        Some(delivered_late),
    );
    let down = copy(
        &mut server_read,
        &mut client_write,
        number,
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

/// Copies `from` to `to` per the current settings, until `from` ends (and what it
/// sent while held is delivered) or a write fails. `held` counts the late deliveries
/// of the direction that can be held (client to server); `None` for the other.
async fn copy(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    number: u64,
    mut settings: watch::Receiver<Settings>,
    held: Option<Arc<AtomicU64>>,
) {
    let silent = |s: &Settings| s.mode == Mode::Blackhole || number < s.silent_below;
    let holding = |s: &Settings| held.is_some() && number < s.held_below;
    let mut buffer = vec![0u8; 16 * 1024];
    // What the client sent while held, in order.
    let mut kept: Vec<u8> = Vec::new();
    let mut open = true;
    loop {
        let read = if kept.is_empty() {
            if !open {
                break;
            }
            from.read(&mut buffer).await
        } else {
            let released = async {
                let _ = settings.wait_for(|s| !holding(s)).await;
            };
            let read = tokio::select! {
                read = from.read(&mut buffer), if open => Some(read),
                () = released => None,
            };
            let Some(read) = read else {
                if to.write_all(&kept).await.is_err() {
                    return;
                }
                if let Some(held) = &held {
                    held.fetch_add(kept.len() as u64, Ordering::SeqCst);
                }
                kept.clear();
                continue;
            };
            read
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
        let delay = now.delay;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        // A blackhole that began during the delay swallows the chunk too.
        if silent(&settings.borrow()) {
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            break;
        }
    }
    // A partition swallows the FIN too: the other side hears nothing.
    if settings.borrow().mode == Mode::Blackhole {
        return;
    }
    let _ = to.shutdown().await;
}
