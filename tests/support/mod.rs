//! What the integration tests share, one tree declared once by each test binary
//! (`mod support;` in `tests/<area>/main.rs` or a single-file test):
//!
//! - servers each test starts on free ports: `redis_server` (single, Sentinel),
//!   `redis_cluster`, `pg_server`, `pgbouncer`, `mysql_server`, `etcd_server`,
//!   `zookeeper_server`, `moto_server` (moto: DynamoDB, S3), `azurite_server`; each
//!   says only how to run its server and tell it is ready: `process` runs them all
//!   (free ports and retries, the log, readiness, pause, kill, restart, cleanup);
//!   `redis_monitor`: the commands a Redis server runs, to count round trips;
//! - `fixtures`: those servers as the testkit's `Deployment` and `Proxied`, with what
//!   the tests add (`Fixture`, `Remote`) and `for_each_fixture!`, so a distributed
//!   test body is written once;
//! - `lateness`: how late the test's timers fire, the margin of a timing assertion;
//! - `occupancy`: who is inside each key's handler, and whether an overlap was signalled;
//! - `ports`: the ports those servers bind, outside the kernel's ephemeral range;
//! - `tcp_proxy`: the fault proxy between an instance and its server;
//! - `recorder` (metrics), `logs` (captured `tracing` output), `soak`, `replay` (the
//!   replay tests' app, client and semantics rows);
//! - here: a real HTTP server on 127.0.0.1 and a client.
//!
//! A binary uses part of it, hence `dead_code` allowed.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

#[cfg(feature = "azure-blob")]
pub mod azurite_server;
#[cfg(feature = "etcd")]
pub mod etcd_server;
#[cfg(any(feature = "dynamodb", feature = "s3"))]
pub mod moto_server;
#[cfg(feature = "mysql")]
pub mod mysql_server;
#[macro_use]
pub mod fixtures;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub mod hold;
#[cfg(feature = "axum")]
pub mod instances;
pub mod lateness;
pub mod logs;
pub mod occupancy;
#[cfg(feature = "postgres")]
pub mod pg_server;
#[cfg(feature = "postgres")]
pub mod pgbouncer;
pub mod ports;
pub mod process;
pub mod recorder;
#[cfg(feature = "redis")]
pub mod redis_cluster;
#[cfg(feature = "redis")]
pub mod redis_monitor;
#[cfg(feature = "redis")]
pub mod redis_server;
#[cfg(feature = "replay")]
pub mod replay;
#[cfg(feature = "axum")]
pub mod soak;
pub mod tcp_proxy;
#[cfg(feature = "zookeeper")]
pub mod zookeeper_server;

/// Serves `app` on a free port of 127.0.0.1 until the test ends.
pub async fn serve(app: Router) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        addr,
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

pub struct Server {
    pub addr: SocketAddr,
    client: Client<HttpConnector, Empty<Bytes>>,
}

/// A response read to the end.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: String,
}

impl Server {
    pub async fn post(&self, path: &str) -> Answer {
        self.send(Request::post(path).body(()).unwrap()).await
    }

    pub async fn send(&self, request: Request<()>) -> Answer {
        let (mut parts, ()) = request.into_parts();
        parts.uri = format!("http://{}{}", self.addr, parts.uri)
            .parse()
            .unwrap();
        let response: Response<_> = self
            .client
            .request(Request::from_parts(parts, Empty::new()))
            .await
            .expect("request failed");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body failed").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    }

    /// Sends a request on a raw connection and returns the connection, so the test
    /// can drop it (a client that disconnects).
    pub async fn send_raw(&self, path: &str) -> TcpStream {
        let mut stream = TcpStream::connect(self.addr).await.unwrap();
        let head = format!("POST {path} HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        stream
    }
}

/// Waits until `condition` holds, failing the test after 5 s.
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Counts the handlers running at once and remembers the most seen.
#[derive(Default)]
pub struct Overlap {
    now: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
}

impl Overlap {
    pub fn enter(&self) -> OverlapGuard<'_> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.now.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(now, SeqCst);
        OverlapGuard(self)
    }

    pub fn max(&self) -> usize {
        self.max.load(std::sync::atomic::Ordering::SeqCst)
    }
}

pub struct OverlapGuard<'a>(&'a Overlap);

impl Drop for OverlapGuard<'_> {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Soaks of one test binary run one at a time: two of them side by side on two cores
/// starve each other's backend commands past their timeout (503s that say nothing about
/// the layer; seen 2 runs in 3 with the Redis soaks). Every soak holds this turn.
pub async fn soak_turn() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ONE_AT_A_TIME.lock().await
}

/// Polls all futures in one task (`join_all` without the futures crate); the outputs
/// in order.
pub async fn join_all<F: std::future::Future>(
    futures: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(value) => *output = Some(value),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(Option::unwrap).collect()
}
