//! One expensive request per user at a time, keyed by the user an auth middleware
//! identified: `KeyedLockLayer::by_extension::<UserId>()`.
//!
//! An `axum::middleware::from_fn` layer reads the bearer token and puts a `UserId` in
//! the request extensions; the lock layer keys on it, with a short `wait_timeout`,
//! `timeout_status(429)` and `max_waiters(2)`. A burst of report exports from one user
//! gets one export and 429s (two waiters time out, the rest find the queue full), while
//! another user's export runs at the same time.
//!
//! Run it with `cargo run --example per_user`. It serves and drives itself on 127.0.0.1
//! and exits non-zero if the responses are not the ones described.

use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::header::AUTHORIZATION;
use http::StatusCode;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tower_keyed_lock::KeyedLockLayer;

/// How long one report export takes.
const EXPORT: Duration = Duration::from_millis(300);
/// How long a queued export may wait: shorter than an export, so waiters give up.
const WAIT: Duration = Duration::from_millis(100);
const BURST: usize = 6;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// The authenticated user; its `Display` form is the lock key.
#[derive(Clone, Copy, Debug)]
struct UserId(u64);

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "user-{}", self.0)
    }
}

/// A stand-in for real authentication: two known bearer tokens.
async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
    let token = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    let user = match token {
        Some("alice-token") => UserId(1),
        Some("bob-token") => UserId(2),
        _ => return Err(StatusCode::UNAUTHORIZED),
    };
    request.extensions_mut().insert(user);
    Ok(next.run(request).await)
}

async fn export_report(Extension(user): Extension<UserId>) -> String {
    tokio::time::sleep(EXPORT).await;
    format!("report exported for {user}")
}

#[tokio::main]
async fn main() {
    let one_export_per_user = KeyedLockLayer::by_extension::<UserId>()
        .wait_timeout(WAIT)
        .timeout_status(StatusCode::TOO_MANY_REQUESTS)
        .max_waiters(2);
    let app = Router::new()
        .route("/reports/export", post(export_report))
        // The layer added last runs first: `authenticate` must insert the UserId before
        // the lock layer looks for it, so it is added after (outside) the lock layer.
        .layer(one_export_per_user.clone())
        .layer(middleware::from_fn(authenticate));
    let addr = serve(app).await;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();

    // A burst from alice, one export from bob, one request without a token; all at once.
    let mut senders = vec![("alice", Some("alice-token")); BURST];
    senders.push(("bob", Some("bob-token")));
    senders.push(("nobody", None));
    let handles: Vec<_> = senders
        .iter()
        .map(|&(_, token)| {
            let uri = format!("http://{addr}/reports/export");
            tokio::spawn(export(client.clone(), uri, token))
        })
        .collect();

    let mut alice = Vec::new();
    let mut others = Vec::new();
    for (handle, (user, _)) in handles.into_iter().zip(&senders) {
        let (status, took, body) = handle.await.unwrap();
        let reason = problem_reason(&body);
        let shown = match &reason {
            Some(reason) => format!("reason: {reason}"),
            None if body.is_empty() => "(empty body)".to_owned(),
            None => body,
        };
        // `StatusCode`'s Display ignores padding, hence `to_string()`.
        println!(
            "{user:<6} -> {:<22} in {:>3} ms  {shown}",
            status.to_string(),
            took.as_millis()
        );
        if *user == "alice" {
            alice.push((status, reason));
        } else {
            others.push(status);
        }
    }
    println!("\nactive_keys() now: {}", one_export_per_user.active_keys());

    let with_status = |wanted| alice.iter().filter(|(s, _)| *s == wanted).count();
    let with_reason = |wanted| {
        alice
            .iter()
            .filter(|(_, r)| r.as_deref() == Some(wanted))
            .count()
    };
    assert_eq!(
        (
            with_status(StatusCode::OK),
            with_status(StatusCode::TOO_MANY_REQUESTS)
        ),
        (1, BURST - 1),
        "alice's burst: one export runs, the others get 429"
    );
    let (timed_out, queue_full) = (with_reason("timeout"), with_reason("queue_full"));
    assert!(
        timed_out > 0 && queue_full > 0,
        "alice's 429s should include wait timeouts and a full queue"
    );
    assert_eq!(
        others,
        [StatusCode::OK, StatusCode::UNAUTHORIZED],
        "bob is served meanwhile; no token is 401"
    );
    assert_eq!(
        one_export_per_user.active_keys(),
        0,
        "no key should stay locked"
    );
}

/// POSTs an export request, with a bearer token if given; returns status, latency, body.
async fn export(
    client: HttpClient,
    uri: String,
    token: Option<&str>,
) -> (StatusCode, Duration, String) {
    let mut request = http::Request::post(uri);
    if let Some(token) = token {
        request = request.header(AUTHORIZATION, format!("Bearer {token}"));
    }
    let started = Instant::now();
    let response = client
        .request(request.body(Empty::new()).unwrap())
        .await
        .expect("request failed");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    (status, started.elapsed(), body)
}

/// The `reason` field of a rejection's problem+json body (`timeout`, `queue_full`, ...).
fn problem_reason(body: &str) -> Option<String> {
    let rest = body.split(r#""reason":""#).nth(1)?;
    rest.split('"').next().map(str::to_owned)
}

/// Serves `app` on a free port of 127.0.0.1 in the background.
async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}
