//! [`SetupError`], why a backend could not be built: the one error of every engine's
//! `build`.

use std::error::Error;
use std::fmt;
use std::time::Duration;

type BoxError = Box<dyn Error + Send + Sync>;

/// Why a backend could not be built. Every engine's `build` returns it.
#[derive(Debug)]
#[non_exhaustive]
pub enum SetupError {
    /// A setting out of the engine's range, or settings that contradict each other:
    /// which, and why.
    Invalid(String),
    /// A setup that would break a guarantee of the lock (an evicting Redis, a
    /// transaction pooler in front of session locks, fencing asked of Redlock): what,
    /// and the fix.
    Unsafe(String),
    /// The engine could not be reached, did not answer in time, or failed a step of the
    /// setup: each server that did, with why.
    Failed {
        /// The engine ("Redis", "PostgreSQL").
        engine: &'static str,
        /// Each server that failed.
        failures: Vec<ServerFailure>,
    },
}

/// One server that failed a backend's setup, and why.
#[derive(Debug)]
#[non_exhaustive]
pub struct ServerFailure {
    /// The server, as configured (a URL or `host:port`, never a password or token).
    pub server: String,
    /// What the client or the server said, or that no answer came in time.
    pub cause: BoxError,
}

impl SetupError {
    /// `engine`'s server `server` failed with `cause`.
    pub(crate) fn failed(
        engine: &'static str,
        server: impl Into<String>,
        cause: impl Into<BoxError>,
    ) -> Self {
        SetupError::Failed {
            engine,
            failures: vec![ServerFailure::new(server, cause)],
        }
    }

    /// `engine`'s server `server` said nothing within `limit`.
    pub(crate) fn no_answer(
        engine: &'static str,
        server: impl Into<String>,
        limit: Duration,
    ) -> Self {
        SetupError::Failed {
            engine,
            failures: vec![ServerFailure::no_answer(server, limit)],
        }
    }
}

impl ServerFailure {
    pub(crate) fn new(server: impl Into<String>, cause: impl Into<BoxError>) -> Self {
        ServerFailure {
            server: server.into(),
            cause: cause.into(),
        }
    }

    /// `server` said nothing within `limit`.
    pub(crate) fn no_answer(server: impl Into<String>, limit: Duration) -> Self {
        Self::new(server, NoAnswer(limit))
    }
}

/// Asserts that `built` was refused as [`SetupError::Invalid`], for a reason that names
/// `named` (a setting, a limit): the check of every engine's builder tests.
#[cfg(test)]
#[track_caller]
pub(crate) fn assert_invalid<T: fmt::Debug>(built: Result<T, SetupError>, named: &str) {
    match built {
        Err(SetupError::Invalid(why)) => assert!(why.contains(named), "{named}: {why}"),
        other => panic!("not refused ({named}): {other:?}"),
    }
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupError::Invalid(why) => write!(f, "lock backend setting refused: {why}"),
            SetupError::Unsafe(why) => write!(f, "unsafe lock setup refused: {why}"),
            SetupError::Failed { engine, failures } => {
                write!(f, "{engine} lock backend setup failed")?;
                for (n, failure) in failures.iter().enumerate() {
                    let separator = if n == 0 { ":" } else { ";" };
                    write!(f, "{separator} at {}: ", failure.server)?;
                    // The sources too, each said once: a client's top error often
                    // says only "io error", and layers repeat their source's words.
                    let mut said = failure.cause.to_string();
                    let mut source = failure.cause.source();
                    while let Some(cause) = source {
                        let text = cause.to_string();
                        if !said.contains(&text) {
                            said = format!("{said}: {text}");
                        }
                        source = cause.source();
                    }
                    f.write_str(&said)?;
                }
                Ok(())
            }
        }
    }
}

impl Error for SetupError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            SetupError::Failed { failures, .. } => {
                failures.first().map(|failure| &*failure.cause as _)
            }
            _ => None,
        }
    }
}

/// A server that said nothing within the limit.
#[derive(Debug)]
struct NoAnswer(Duration);

impl fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no answer within {:?}", self.0)
    }
}

impl Error for NoAnswer {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failed_server_is_named_with_its_causes_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = SetupError::Failed {
            engine: "Test",
            failures: vec![
                ServerFailure::new("a:1", io),
                ServerFailure::no_answer("b:2", Duration::from_millis(300)),
            ],
        };
        assert_eq!(
            error.to_string(),
            "Test lock backend setup failed: at a:1: refused; at b:2: no answer within 300ms"
        );
        assert!(error.source().is_some());
    }
}
