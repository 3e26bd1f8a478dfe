//! [`Health`]: what a backend's health check found, for a readiness probe or a health
//! route.
//!
//! The check is the lock itself, not a ping: it takes a reserved key
//! ([`HEALTH_LOCK_NAME`] / [`HEALTH_PROBE_KEY`]), waiting at most [`HEALTH_PROBE_WAIT`],
//! and gives it back. So it proves what the locks need — the engine answers, and lets
//! this instance write (a replica promoted read-only, a missing write permission, a
//! full disk fail it) — on every engine, with the engine's own timeouts. Another
//! instance's check holding the key at that moment hands it over within the wait; a
//! key still held when the wait is over (checks of many instances at once on a loaded
//! engine, or one that crashed mid-check and left the key to its lease) is an answer
//! too: the engine said who holds it, so the check is healthy, not a fleet made unready
//! by one instance's probe.

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::{Acquisition, RetryLater};
use crate::error::LockError;

/// The lock name of the health check's key at the backend (beside the layers' names).
pub const HEALTH_LOCK_NAME: &str = "keyed_lock_health";
/// The key the health check takes and gives back under [`HEALTH_LOCK_NAME`].
pub const HEALTH_PROBE_KEY: &str = "probe";
/// How long the health check waits for its key: long enough for another instance's
/// check to hand it over, short enough for a readiness probe's timeout. A key still
/// held by then counts as an answer (the engine said so).
pub const HEALTH_PROBE_WAIT: Duration = Duration::from_millis(500);

/// What a health check found: whether the engine answered (and how fast), why not,
/// how long the Redis restart guard still refuses grants, and the last backend error
/// the locks met. See [`LockBackend::health`](super::LockBackend::health).
///
/// With the `axum` feature it is a response: `200` when healthy, else `503`, with a
/// small JSON body.
///
/// ```no_run
/// # #[cfg(all(feature = "axum", feature = "redis"))]
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use axum::{routing::get, Router};
/// use tower_keyed_lock::{KeyedLockLayer, RedisBackend};
///
/// let orders = KeyedLockLayer::by_path("order_id")
///     .backend(RedisBackend::connect("redis://127.0.0.1/").await?);
/// let health = orders.health_check();
/// let app: Router = Router::new()
///     .route("/orders/{order_id}", axum::routing::post(|| async { "paid" }))
///     .route_layer(orders)
///     .route("/ready", get(move || async move { health.check().await }));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Health {
    engine: &'static str,
    /// The round trip, or why the engine did not answer; `None`: not checked.
    answer: Option<Result<Duration, String>>,
    restart_guard_left: Option<Duration>,
    last_error: Option<LastError>,
    /// The locks' graceful shutdown has begun: they grant no key any more.
    shutting_down: bool,
}

/// The last backend error some locks met: when, and what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastError {
    /// When it happened (wall clock, for a log line or a status page).
    pub at: SystemTime,
    /// What it said.
    pub message: String,
}

impl Health {
    /// The engine answered within `round_trip`.
    pub fn answered(engine: &'static str, round_trip: Duration) -> Self {
        Self::with(engine, Some(Ok(round_trip)))
    }

    /// The engine did not answer, or answered with an error.
    pub fn unreachable(engine: &'static str, error: impl fmt::Display) -> Self {
        Self::with(engine, Some(Err(error.to_string())))
    }

    /// Nothing was checked: in process (no engine), or a backend without a check.
    /// Counts as healthy.
    pub fn unchecked(engine: &'static str) -> Self {
        Self::with(engine, None)
    }

    fn with(engine: &'static str, answer: Option<Result<Duration, String>>) -> Self {
        Self {
            engine,
            answer,
            restart_guard_left: None,
            last_error: None,
            shutting_down: false,
        }
    }

    /// The locks are shutting down ([`DistributedLocks::shutdown`](crate::DistributedLocks::shutdown)
    /// began): unhealthy whatever the engine would answer, so that a readiness probe
    /// takes the instance out of rotation while it drains. The engine is not asked.
    pub fn shutting_down(engine: &'static str) -> Self {
        let mut health = Self::with(engine, None);
        health.shutting_down = true;
        health
    }

    /// Whether the engine answered the check (or nothing was to be checked), and the
    /// locks are not shutting down. The
    /// restart guard and the last error are reported beside it, not counted: a guard
    /// delays grants on every instance alike, and an old error is history.
    pub fn is_healthy(&self) -> bool {
        !self.shutting_down && !matches!(self.answer, Some(Err(_)))
    }

    /// Whether the locks' graceful shutdown has begun (then never healthy).
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// The engine's short name (`"redis"`, `"postgres"`, …).
    pub fn engine(&self) -> &'static str {
        self.engine
    }

    /// How long the check took, when the engine answered.
    pub fn round_trip(&self) -> Option<Duration> {
        self.answer.as_ref()?.as_ref().ok().copied()
    }

    /// Why the check failed, when it did.
    pub fn error(&self) -> Option<&str> {
        self.answer.as_ref()?.as_ref().err().map(String::as_str)
    }

    /// How long the Redis restart guard still refuses every grant (the server restarted
    /// less than a lease ago and may have lost held keys); `None` when it does not.
    pub fn restart_guard_left(&self) -> Option<Duration> {
        self.restart_guard_left
    }

    /// The last backend error the locks met (an acquisition that failed, a lease
    /// lost), when the check was asked through them.
    pub fn last_error(&self) -> Option<&LastError> {
        self.last_error.as_ref()
    }

    pub(crate) fn and_last_error(mut self, last_error: Option<LastError>) -> Self {
        self.last_error = last_error;
        self
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.answer {
            _ if self.shutting_down => write!(f, "{}: shutting down", self.engine)?,
            Some(Ok(round_trip)) => write!(f, "{}: answered in {round_trip:?}", self.engine)?,
            Some(Err(error)) => write!(f, "{}: unreachable: {error}", self.engine)?,
            None => write!(f, "{}: not checked", self.engine)?,
        }
        if let Some(left) = self.restart_guard_left {
            write!(f, "; restart guard for {left:?} more")?;
        }
        if let Some(last) = &self.last_error {
            write!(f, "; last error: {}", last.message)?;
        }
        Ok(())
    }
}

/// The check every backend gets (see the module docs): `acquisition` is the attempt on
/// the probe key, waiting at most [`HEALTH_PROBE_WAIT`].
pub(crate) async fn probe(engine: &'static str, acquisition: Acquisition) -> Health {
    let sent = Instant::now();
    let result = acquisition.await;
    let round_trip = sent.elapsed();
    match result {
        Ok(lease) => {
            lease.release().await;
            Health::answered(engine, round_trip)
        }
        Err(LockError::Backend(error)) => match error.downcast_ref::<RetryLater>() {
            Some(guard) => {
                let mut health = Health::answered(engine, round_trip);
                health.restart_guard_left = Some(guard.retry_after());
                health
            }
            None => Health::unreachable(engine, error),
        },
        // The engine answered: another instance's check holds the probe key.
        Err(LockError::Timeout | LockError::Busy) => Health::answered(engine, round_trip),
        Err(error) => Health::unreachable(engine, error),
    }
}

/// The last backend error a set of locks met, kept for their health check.
#[derive(Debug, Default)]
pub(crate) struct LastErrorCell(Mutex<Option<LastError>>);

impl LastErrorCell {
    pub(crate) fn record(&self, error: impl fmt::Display) {
        let last = LastError {
            at: SystemTime::now(),
            message: error.to_string(),
        };
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(last);
    }

    pub(crate) fn get(&self) -> Option<LastError> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Health {
    /// The JSON body of the health response: `{"status":"ok"|"unavailable"|"unchecked"|
    /// "shutting_down", "engine":…, "round_trip_ms":…, "error":…,
    /// "restart_guard_left_ms":…, "last_error":…}` (absent fields left out).
    pub fn to_json(&self) -> String {
        let status = match &self.answer {
            _ if self.shutting_down => "shutting_down",
            Some(Ok(_)) => "ok",
            Some(Err(_)) => "unavailable",
            None => "unchecked",
        };
        let mut json = format!(
            r#"{{"status":"{status}","engine":{}"#,
            crate::json_text::quoted(self.engine)
        );
        if let Some(round_trip) = self.round_trip() {
            json += &format!(r#","round_trip_ms":{:.3}"#, round_trip.as_secs_f64() * 1e3);
        }
        if let Some(error) = self.error() {
            json += &format!(r#","error":{}"#, crate::json_text::quoted(error));
        }
        if let Some(left) = self.restart_guard_left {
            json += &format!(r#","restart_guard_left_ms":{}"#, left.as_millis());
        }
        if let Some(last) = &self.last_error {
            json += &format!(
                r#","last_error":{}"#,
                crate::json_text::quoted(&last.message)
            );
        }
        json + "}"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_unless_the_engine_failed_to_answer() {
        assert!(Health::answered("redis", Duration::from_millis(1)).is_healthy());
        assert!(Health::unchecked("in-process").is_healthy());
        let down = Health::unreachable("redis", "connection refused");
        assert!(!down.is_healthy());
        assert_eq!(down.error(), Some("connection refused"));
        assert_eq!(down.round_trip(), None);
    }

    #[tokio::test]
    async fn a_probe_key_held_elsewhere_is_an_answer() {
        for held in [LockError::Timeout, LockError::Busy] {
            let acquisition: Acquisition = Box::pin(async move { Err(held) });
            let health = probe("redis", acquisition).await;
            assert!(health.is_healthy(), "{health}");
            assert!(health.round_trip().is_some(), "{health}");
        }
        let acquisition: Acquisition =
            Box::pin(async { Err(LockError::Backend("connection refused".into())) });
        let health = probe("redis", acquisition).await;
        assert!(!health.is_healthy(), "{health}");
    }

    #[test]
    fn the_json_escapes_what_an_error_says() {
        let down = Health::unreachable("postgres", "bad \"quote\"\\ and\nnewline");
        assert_eq!(
            down.to_json(),
            r#"{"status":"unavailable","engine":"postgres","error":"bad \"quote\"\\ and\u000anewline"}"#
        );
        let up = Health::answered("redis", Duration::from_micros(1500));
        assert_eq!(
            up.to_json(),
            r#"{"status":"ok","engine":"redis","round_trip_ms":1.500}"#
        );
    }
}
