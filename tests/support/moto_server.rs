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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
    port: u16,
    child: Option<Child>,
    misbehaviour: Misbehaviour,
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
        let mut last_error = String::new();
        for _ in 0..5 {
            // Port 0: moto binds a free port and says which.
            let mut server = Self {
                port: 0,
                child: None,
                misbehaviour,
            };
            match server.spawn() {
                Ok(()) => return server,
                Err(error) => last_error = error,
            }
        }
        panic!("could not start moto: {last_error}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
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
        self.child.as_ref().expect("moto is stopped").id()
    }

    /// Kills the server (SIGKILL: it loses every table, like a crash of a store
    /// without disk).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a fresh (empty) server on the same port.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self.spawn() {
                Ok(()) => return,
                Err(error) if Instant::now() > deadline => {
                    panic!("could not restart moto: {error}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        signal(self.pid(), "-STOP");
    }

    /// Undoes [`pause`](Self::pause).
    pub fn resume(&self) {
        signal(self.pid(), "-CONT");
    }

    fn spawn(&mut self) -> Result<(), String> {
        let mut command = Command::new("python3");
        match self.misbehaviour {
            Misbehaviour::None => {}
            Misbehaviour::IgnorePreconditions => {
                command.env("MOTO_IGNORE_PRECONDITIONS", "1");
            }
            Misbehaviour::ConflictEvery(n) => {
                command.env("MOTO_CONFLICT_EVERY", n.to_string());
            }
            Misbehaviour::ClockAhead(seconds) => {
                const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
                assert!(
                    std::path::Path::new(LIBFAKETIME).exists(),
                    "{LIBFAKETIME} not found: this test needs libfaketime (Debian: \
                     `apt-get install faketime`; scripts/test installs it)"
                );
                command
                    .env("LD_PRELOAD", LIBFAKETIME)
                    .env("FAKETIME", format!("+{seconds}"))
                    // Only the wall clock is off.
                    .env("DONT_FAKE_MONOTONIC", "1");
            }
        }
        let mut child = command
            .args(["-c", LAUNCHER, &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|error| match error.kind() {
                std::io::ErrorKind::NotFound => panic!(
                    "python3 is not on PATH: the DynamoDB and S3 tests run moto; run ./scripts/test, \
                     which installs it"
                ),
                _ => format!("spawning moto: {error}"),
            })?;
        // The port line comes once moto listens (an empty read: it exited).
        let mut line = String::new();
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let _ = stdout.read_line(&mut line);
        if let Ok(port) = line.trim().parse() {
            self.port = port;
        }
        // Anything moto prints later must not find the pipe closed.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let mut stderr = String::new();
                if let Some(mut pipe) = child.stderr.take() {
                    let _ = pipe.read_to_string(&mut stderr);
                }
                if stderr.contains("No module named") {
                    panic!(
                        "moto is not installed: run ./scripts/test, which installs it \
                         (or python3 -m pip install 'moto[server]'): {stderr}"
                    );
                }
                return Err(format!("moto exited with {status}: {stderr}"));
            }
            if answers(self.port) {
                // Werkzeug logs every request to stderr: stop reading it, drain it.
                if let Some(mut pipe) = child.stderr.take() {
                    std::thread::spawn(move || std::io::copy(&mut pipe, &mut std::io::sink()));
                }
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err("moto did not answer within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        // SIGKILL also ends a paused (stopped) process.
        self.stop();
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

fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill {signal} {pid} failed");
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
