//! The fault-injection proxy of the test support does what the backend tests rely on.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

use crate::support::tcp_proxy::TcpProxy;

/// An echo server on a free port.
async fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buffer = [0u8; 1024];
                while let Ok(n) = stream.read(&mut buffer).await {
                    if n == 0 || stream.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

async fn round_trip(stream: &mut TcpStream, within: Duration) -> std::io::Result<Vec<u8>> {
    stream.write_all(b"ping").await?;
    let mut reply = [0u8; 4];
    match timeout(within, stream.read_exact(&mut reply)).await {
        Ok(result) => result.map(|_| reply.to_vec()),
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

#[tokio::test]
async fn forwards_blackholes_heals_delays_and_resets() {
    let proxy = TcpProxy::start(echo_server().await).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    let short = Duration::from_millis(300);
    assert_eq!(round_trip(&mut stream, short).await.unwrap(), b"ping");

    proxy.blackhole();
    let silent = round_trip(&mut stream, short).await.unwrap_err();
    assert_eq!(
        silent.kind(),
        std::io::ErrorKind::TimedOut,
        "a blackhole is silent"
    );
    proxy.heal();
    assert_eq!(round_trip(&mut stream, short).await.unwrap(), b"ping");

    proxy.delay(Duration::from_millis(200));
    let started = std::time::Instant::now();
    assert_eq!(
        round_trip(&mut stream, Duration::from_secs(2))
            .await
            .unwrap(),
        b"ping"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "delayed each way"
    );
    proxy.delay(Duration::ZERO);

    proxy.reset();
    let mut buffer = [0u8; 4];
    let read = timeout(Duration::from_secs(2), stream.read(&mut buffer))
        .await
        .unwrap();
    assert!(
        matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "a reset closes with RST: {read:?}"
    );
    // A new connection works after a reset.
    let mut fresh = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(round_trip(&mut fresh, short).await.unwrap(), b"ping");
}

#[tokio::test]
async fn holds_what_old_connections_send_and_delivers_it_late_in_order() {
    let proxy = TcpProxy::start(echo_server().await).await;
    let short = Duration::from_millis(300);
    let mut old = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(round_trip(&mut old, short).await.unwrap(), b"ping");

    proxy.hold_existing();
    old.write_all(b"late").await.unwrap();
    let held = round_trip(&mut old, short).await.unwrap_err();
    assert_eq!(
        held.kind(),
        std::io::ErrorKind::TimedOut,
        "held, not echoed"
    );
    assert_eq!(proxy.delivered_late(), 0);
    // New connections forward meanwhile.
    let mut fresh = TcpStream::connect(proxy.addr).await.unwrap();
    assert_eq!(round_trip(&mut fresh, short).await.unwrap(), b"ping");

    proxy.release_held();
    let mut echoed = [0u8; 8];
    timeout(Duration::from_secs(2), old.read_exact(&mut echoed))
        .await
        .expect("delivered once released")
        .unwrap();
    assert_eq!(&echoed, b"lateping", "in the order sent");
    assert_eq!(proxy.delivered_late(), 8);
}
