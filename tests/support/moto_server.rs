//! A real AWS-compatible server (moto, from PyPI: DynamoDB, and S3 with path-style
//! addressing, from one server app) on a free port of 127.0.0.1, killed on drop, and
//! clients for it with static fake credentials.
//!
//! moto runs each request in a thread of its own and does not lock an item or object
//! between a condition check and the write, so two conditional writes can both pass.
//! DynamoDB and S3 apply conditional writes on an item or object atomically; to give
//! the tests that guarantee, the launcher below runs moto's WSGI app behind one lock
//! (one request at a time).
// The benchmarks' crate, which has no features, includes this file for its launcher.
#![allow(dead_code, unexpected_cfgs)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use super::process::{missing, runs, ServerProcess, TempDir};

/// The launcher: moto's server app, one request at a time, on `127.0.0.1:argv[1]`
/// (0: a free port). It binds first and prints the port it got: a port picked by the
/// test and bound later could meanwhile go to another test's server, which would then
/// be taken for moto.
///
/// moto keeps every model object it ever made (each item version of every write) in a
/// registry for its dashboard, so its heap grows with every write and Python's full
/// garbage collection, which runs less often as the heap grows, pauses the server for
/// longer each time: past 1.4 s late in a 100 000-request soak, where requests queued
/// behind the pause then outlast the command timeout. The launcher empties that
/// registry every 256 requests.
///
/// Two misbehaviours of a store, for the tests that a backend meets them: with
/// `MOTO_IGNORE_PRECONDITIONS` set, it drops `If-Match` and `If-None-Match` from every
/// request before moto sees it (a store that ignores conditional writes, which a backend
/// must refuse to run on); with `MOTO_CONFLICT_EVERY=n`, it answers every n-th
/// conditional write or delete (but those of a setup probe) 409
/// `ConditionalRequestConflict` without applying it, as S3 does when conditional
/// writes on one object race.
///
/// With `MOTO_SLOW_LOG` set to a file, every request that took over 200 ms is logged
/// there with where the time went: waiting for the lock, and in moto.
const LAUNCHER: &str = r#"
import os, sys, threading, time
from werkzeug.serving import make_server
from moto.core.model_instances import reset_model_data
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()
served = 0
slow_log = os.environ.get("MOTO_SLOW_LOG")
slow_log = open(slow_log, "a", buffering=1) if slow_log else None
ignore_preconditions = bool(os.environ.get("MOTO_IGNORE_PRECONDITIONS"))
conflict_every = int(os.environ.get("MOTO_CONFLICT_EVERY") or 0)
conditional = 0
CONFLICT = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict'
            b'</Code><Message>A conflicting conditional operation is currently in progress '
            b'against this resource.</Message></Error>')
def conflicts(environ):
    global conditional
    if not conflict_every or environ.get("REQUEST_METHOD") not in ("PUT", "DELETE"):
        return False
    if not (environ.get("HTTP_IF_MATCH") or environ.get("HTTP_IF_NONE_MATCH")):
        return False
    if "probe" in environ.get("PATH_INFO", ""):
        return False
    conditional += 1
    return conditional % conflict_every == 0
def one_at_a_time(environ, start_response):
    global served
    if ignore_preconditions:
        environ.pop("HTTP_IF_MATCH", None)
        environ.pop("HTTP_IF_NONE_MATCH", None)
    started = time.monotonic()
    with lock:
        locked = time.monotonic()
        if conflicts(environ):
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            start_response("409 Conflict", [("Content-Type", "application/xml"),
                                            ("Content-Length", str(len(CONFLICT)))])
            return [CONFLICT]
        body = list(app(environ, start_response))
        served += 1
        if served % 256 == 0:
            reset_model_data()
    done = time.monotonic()
    if slow_log and done - started > 0.2:
        slow_log.write("%.3f lock %.3f moto %.3f %s\n" % (
            time.time(), locked - started, done - locked,
            environ.get("HTTP_X_AMZ_TARGET", "")))
    return body
server = make_server("127.0.0.1", int(sys.argv[1]), one_at_a_time, threaded=True)
print(server.server_port, flush=True)
server.serve_forever()
"#;

pub struct MotoServer {
    process: ServerProcess,
}

/// How a server started for a test departs from a store's rules (see [`LAUNCHER`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misbehaviour {
    /// None: moto as it is, one request at a time.
    None,
    /// `If-Match` and `If-None-Match` dropped from every request.
    IgnorePreconditions,
    /// Every n-th conditional write or delete answered 409, not applied.
    ConflictEvery(u32),
    /// Its wall clock (and so the `Date` of its answers) this many seconds ahead of
    /// this machine's, through libfaketime: a host with broken time sync.
    ClockAhead(u32),
}

impl MotoServer {
    /// Starts a server on a free port; panics if moto is not installed.
    pub fn start() -> Self {
        Self::misbehaving(Misbehaviour::None)
    }

    /// Starts a server that departs from a store's rules as `misbehaviour` says.
    pub fn misbehaving(misbehaviour: Misbehaviour) -> Self {
        require_moto();
        let process = ServerProcess::new("moto", TempDir::new("moto"))
            .command(move |process| command(misbehaviour, process.port()))
            // Port 0 at first: the launcher binds a free port and prints it.
            .port_announced(|line| line.trim().parse().ok().filter(|&port| port != 0))
            .ready_when(|process| answers(process.port()))
            .ready_within(Duration::from_secs(30))
            .poll_every(Duration::from_millis(50))
            .start(5);
        Self { process }
    }

    pub fn port(&self) -> u16 {
        self.process.port()
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port())
    }

    /// A DynamoDB client of this server (its own connection pool: one instance of an
    /// app).
    #[cfg(feature = "dynamodb")]
    pub fn client(&self) -> aws_sdk_dynamodb::Client {
        client_for(&self.url())
    }

    /// An S3 client of this server (its own connection pool: one instance of an app).
    #[cfg(feature = "s3")]
    pub fn s3_client(&self) -> aws_sdk_s3::Client {
        s3_client_for(&self.url())
    }

    /// The process id of the running server.
    pub fn pid(&self) -> u32 {
        self.process.pid().expect("moto is stopped")
    }

    /// Kills the server (SIGKILL: it loses every table, like a crash of a store
    /// without disk).
    pub fn stop(&mut self) {
        self.process.kill();
    }

    /// Starts a fresh (empty) server on the same port.
    pub fn restart(&mut self) {
        self.process.restart();
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// Undoes [`pause`](Self::pause).
    pub fn resume(&self) {
        self.process.resume();
    }
}

/// The launcher on `port` (0: a free one), misbehaving as told.
fn command(misbehaviour: Misbehaviour, port: u16) -> Command {
    let mut command = Command::new("python3");
    match misbehaviour {
        Misbehaviour::None => {}
        Misbehaviour::IgnorePreconditions => {
            command.env("MOTO_IGNORE_PRECONDITIONS", "1");
        }
        Misbehaviour::ConflictEvery(n) => {
            command.env("MOTO_CONFLICT_EVERY", n.to_string());
        }
        Misbehaviour::ClockAhead(seconds) => {
            const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
            if !std::path::Path::new(LIBFAKETIME).exists() {
                missing(LIBFAKETIME, " (Debian package faketime)");
            }
            command
                .env("LD_PRELOAD", LIBFAKETIME)
                .env("FAKETIME", format!("+{seconds}"))
                // Only the wall clock is off.
                .env("DONT_FAKE_MONOTONIC", "1");
        }
    }
    command.args(["-c", LAUNCHER, &port.to_string()]);
    command
}

/// Panics, saying how to install it, unless python3 can import moto (looked at once).
fn require_moto() {
    static FOUND: OnceLock<bool> = OnceLock::new();
    if !*FOUND.get_or_init(|| runs("python3", &["-c", "import moto, werkzeug"])) {
        missing(
            "python3 with moto (`import moto` failed)",
            " (pip package moto[server])",
        );
    }
}

/// A client of the DynamoDB endpoint at `url` with static fake credentials.
#[cfg(feature = "dynamodb")]
pub fn client_for(url: &str) -> aws_sdk_dynamodb::Client {
    use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("test", "test", None, None, "static"))
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// A client of the S3 endpoint at `url` (path-style: the bucket in the path, as moto
/// serves it on an address) with static fake credentials.
#[cfg(feature = "s3")]
pub fn s3_client_for(url: &str) -> aws_sdk_s3::Client {
    use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
    let config = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .force_path_style(true)
        .credentials_provider(Credentials::new("test", "test", None, None, "static"))
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

/// Whether an HTTP server on `port` answers a request.
fn answers(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(2000)));
    if stream
        .write_all(b"GET /moto-api/ HTTP/1.0\r\nhost: localhost\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 8];
    stream.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.")
}
