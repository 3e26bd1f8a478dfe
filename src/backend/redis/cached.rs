//! Scripts sent by their SHA1 (`EVALSHA`), with their text only when the server asks.

use std::sync::LazyLock;

use redis::aio::ConnectionLike;
use redis::{Arg, Cmd, ErrorKind, FromRedisValue, RedisResult, ServerErrorKind};

/// The most arguments a script of this crate is called with (`EVALSHA` and the hash
/// included).
const MAX_ARGS: usize = 24;

/// A Lua script and its SHA1, hashed once.
pub(in crate::backend) struct CachedScript {
    text: &'static str,
    hash: String,
}

impl CachedScript {
    pub(in crate::backend) fn new(text: &'static str) -> Self {
        let hash = redis::Script::new(text).get_hash().to_owned();
        Self { text, hash }
    }

    /// `EVALSHA hash` followed by what `body` adds (key count, keys, arguments), about
    /// `bytes` long. Written into buffers of that size from the start: a command grown
    /// argument by argument reallocates several times, and on a busy runtime the
    /// allocator's locks are then most of what a lock costs this process.
    pub(in crate::backend) fn command(&self, bytes: usize, body: impl FnOnce(&mut Cmd)) -> Cmd {
        let mut command = Cmd::with_capacity(MAX_ARGS, "EVALSHA".len() + self.hash.len() + bytes);
        command.arg("EVALSHA").arg(&self.hash);
        body(&mut command);
        command
    }

    /// Runs `command` (made by [`command`](Self::command)). Redis then neither receives
    /// nor hashes the script's text again. A server that lost its script cache (a
    /// restart, a failover, `SCRIPT FLUSH`) answers NOSCRIPT, and the same call goes
    /// once more as `EVAL` with the text, which caches it again: one round trip more
    /// after such an event, none otherwise (`redis::Script` would add two: `SCRIPT LOAD`,
    /// then `EVALSHA` again).
    pub(in crate::backend) async fn run<T: FromRedisValue>(
        &self,
        command: &Cmd,
        connection: &mut impl ConnectionLike,
    ) -> RedisResult<T> {
        match command.query_async(connection).await {
            Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(self.text);
                // The hash is the second argument; the rest is the body.
                for arg in command.args_iter().skip(2) {
                    if let Arg::Simple(bytes) = arg {
                        eval.arg(bytes);
                    }
                }
                eval.query_async(connection).await
            }
            answer => answer,
        }
    }
}

/// The scripts on every lock's path: hashed once per process.
pub(super) static ACQUIRE: LazyLock<CachedScript> =
    LazyLock::new(|| CachedScript::new(super::scripts::ACQUIRE));
pub(super) static ACQUIRE_COUNTED: LazyLock<CachedScript> =
    LazyLock::new(|| CachedScript::new(super::scripts::ACQUIRE_COUNTED));
pub(super) static RELEASE: LazyLock<CachedScript> =
    LazyLock::new(|| CachedScript::new(super::scripts::RELEASE));
pub(super) static RELEASE_COUNTED: LazyLock<CachedScript> =
    LazyLock::new(|| CachedScript::new(super::scripts::RELEASE_COUNTED));
