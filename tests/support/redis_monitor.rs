//! Round trips counted by Redis itself: `redis-cli monitor` streams every command the
//! server runs, in the order it runs them, tagged with the client that sent it (or
//! `lua` for a command a script ran). A test marks moments with `ECHO` from a client
//! of its own and counts the commands other clients sent between two marks: on a path
//! that waits for each answer before the next command, each is one round trip.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a mark may take to appear in the stream.
const MARK_PATIENCE: Duration = Duration::from_secs(10);

/// The commands a Redis server runs, as `redis-cli monitor` reports them.
pub struct Monitor {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    marker: redis::aio::MultiplexedConnection,
}

impl Monitor {
    /// Starts monitoring the server on `port` (`redis-cli` must be installed with
    /// `redis-server`).
    pub async fn start(port: u16) -> Monitor {
        let mut child = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "monitor"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-cli (installed with redis-server) runs");
        let stdout = child.stdout.take().expect("piped stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        std::thread::spawn({
            let lines = Arc::clone(&lines);
            move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
            }
        });
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
        let marker = client
            .get_multiplexed_async_connection()
            .await
            .expect("the marking client connects");
        let monitor = Monitor {
            child,
            lines,
            marker,
        };
        // The stream is live once a mark shows in it: mark until one does.
        let deadline = Instant::now() + MARK_PATIENCE;
        while !monitor
            .try_mark("monitor-started", Duration::from_millis(200))
            .await
        {
            assert!(
                Instant::now() < deadline,
                "redis-cli monitor showed nothing"
            );
        }
        monitor
    }

    /// Marks this moment in the stream, once the server has run it.
    pub async fn mark(&self, name: &str) {
        assert!(
            self.try_mark(name, MARK_PATIENCE).await,
            "mark {name} never showed in MONITOR"
        );
    }

    /// Sends the mark `name`; whether it showed in the stream within `patience`.
    async fn try_mark(&self, name: &str, patience: Duration) -> bool {
        let quoted = format!("\"ECHO\" \"{name}\"");
        let seen = || {
            let lines = self.lines.lock().unwrap();
            lines.iter().filter(|l| l.ends_with(&quoted)).count()
        };
        let before = seen();
        let mut marker = self.marker.clone();
        let _: String = redis::cmd("ECHO")
            .arg(name)
            .query_async(&mut marker)
            .await
            .expect("ECHO answered");
        let deadline = Instant::now() + patience;
        while seen() == before {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// The commands clients other than the marking one sent (not those scripts ran)
    /// between the last mark `from` and the first mark `to` after it, each as its
    /// command name and first argument; `None` if there is no `to` after `from`.
    pub fn sent_between(&self, from: &str, to: &str) -> Option<Vec<String>> {
        let lines = self.lines.lock().unwrap();
        let is_mark = |name: &str, line: &String| line.ends_with(&format!("\"ECHO\" \"{name}\""));
        let start = lines
            .iter()
            .rposition(|line| is_mark(from, line))
            .unwrap_or_else(|| panic!("no mark {from}"));
        let end = start
            + 1
            + lines[start + 1..]
                .iter()
                .position(|line| is_mark(to, line))?;
        let marker_client = client_of(&lines[start]);
        let sent = lines[start + 1..end]
            .iter()
            .filter(|line| {
                let client = client_of(line);
                client != "lua" && client != marker_client
            })
            .map(|line| command_of(line))
            .collect();
        Some(sent)
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `1700000000.123456 [0 127.0.0.1:5000] "GET" "k"` → `127.0.0.1:5000`; `lua` for a
/// command a script ran.
fn client_of(line: &str) -> &str {
    let inside = line
        .split_once('[')
        .and_then(|(_, rest)| rest.split_once(']'));
    inside
        .and_then(|(tag, _)| tag.split_whitespace().nth(1))
        .unwrap_or("")
}

/// The command name and its first argument, shortened.
fn command_of(line: &str) -> String {
    let words = line.split_once("] ").map_or("", |(_, words)| words);
    let mut parts = words.splitn(3, ' ');
    let name = parts
        .next()
        .unwrap_or("")
        .trim_matches('"')
        .to_ascii_uppercase();
    let first: String = parts.next().unwrap_or("").chars().take(40).collect();
    format!("{name} {first}")
}
