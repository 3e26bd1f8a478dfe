//! Building a backend: connect, check what its lock scope needs (a session of its own
//! for session locks, a fencing sequence that only increases), and [`SetupError`], which
//! says what is wrong, naming the server's address (never the password) when it cannot
//! be reached.

use std::error::Error;

use tokio::time::Instant;
use tokio_postgres::config::Host;

use super::error::{PgError, UNSAFE_SEQUENCE};
use super::{Inner, LockScope, PostgresBackend, PostgresBackendBuilder};
use crate::backend::SetupError;
use crate::error::LockError;

/// How errors name the engine.
const ENGINE: &str = "PostgreSQL";

impl Inner {
    /// A setup step failed with `cause`, at this backend's server.
    pub(super) fn setup_failed(
        &self,
        cause: impl Into<Box<dyn Error + Send + Sync>>,
    ) -> SetupError {
        let server = self.address.as_deref().unwrap_or("the pool's server");
        SetupError::failed(ENGINE, server, cause)
    }

    /// A setup step that reports a [`LockError`] failed: not reachable, or failed.
    pub(super) fn setup_failed_with(&self, error: LockError) -> SetupError {
        match error {
            LockError::Backend(error) => self.setup_failed(error),
            LockError::Timeout => self.setup_failed(PgError::message(
                "no pooled connection to PostgreSQL came within the command timeout",
            )),
            other => self.setup_failed(other),
        }
    }
}

/// The [`LockError`] of an acquisition whose setup check (run on first use too)
/// failed.
pub(super) fn into_lock_error(error: SetupError) -> LockError {
    LockError::Backend(Box::new(error))
}

/// Where `config` connects to, for errors: `host:port` for each host (`[v6]:port`, a
/// socket path for a Unix socket), `hostaddr`s when no host is named; never a user or
/// password.
pub(super) fn address(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    let port = |index: usize| ports.get(index).or(ports.first()).copied().unwrap_or(5432);
    let tcp = |host: &str, port: u16| match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    };
    let mut named: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(index, host)| match host {
            Host::Tcp(host) => tcp(host, port(index)),
            #[cfg(unix)]
            Host::Unix(dir) => format!("{}/.s.PGSQL.{}", dir.display(), port(index)),
        })
        .collect();
    if named.is_empty() {
        named = config
            .get_hostaddrs()
            .iter()
            .enumerate()
            .map(|(index, addr)| tcp(&addr.to_string(), port(index)))
            .collect();
    }
    match named.is_empty() {
        true => "an unnamed host".to_owned(),
        false => named.join(", "),
    }
}

impl PostgresBackendBuilder {
    /// The backend, connecting on first use (as sqlx's `connect_lazy`): for a service
    /// that must start while the database is down. The checks of
    /// [`build`](Self::build) then run at its first acquisitions, and fail them with
    /// the same error (503, or the in-process lock alone with
    /// [`fail_open`](crate::KeyedLockLayer::fail_open)) until they pass.
    ///
    /// # Panics
    /// If a setting was refused (what [`build`](Self::build) returns as
    /// [`SetupError::Invalid`]): a configuration mistake, not a server's state.
    pub fn build_lazy(self) -> PostgresBackend {
        PostgresBackend {
            inner: self.draft.finish_lazy("PostgresBackendBuilder"),
        }
    }

    /// Connects and checks the setup:
    ///
    /// - PostgreSQL is reachable (else [`SetupError::Failed`], naming its address);
    /// - with [`LockScope::Session`] (the default), each session belongs to its client
    ///   connection alone: a transaction or statement pooler in between (PgBouncer
    ///   `pool_mode=transaction` or `statement`) is refused with
    ///   [`SetupError::Unsafe`], whatever its pool size and reset settings (see
    ///   [Lock scopes and poolers](super#lock-scopes-and-poolers));
    /// - with [`fencing`](Self::fencing), the sequence exists (it is created if
    ///   missing) and issues increasing tokens.
    ///
    /// Takes up to four [`command_timeout`](Self::command_timeout)s.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_keyed_lock::backend::SetupError> {
    /// use tower_keyed_lock::backend::postgres::PostgresBackend;
    ///
    /// let backend = PostgresBackend::builder_from_str("host=db.internal user=app dbname=app")?
    ///     .fencing(true)
    ///     .build()
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn build(self) -> Result<PostgresBackend, SetupError> {
        let backend = PostgresBackend {
            inner: self.draft.finish()?,
        };
        let inner = &backend.inner;
        let deadline = Instant::now() + inner.settings.timing.command_timeout;
        match inner.scope {
            LockScope::Session => inner.check_own_sessions().await?,
            // Only reachable: one round trip on a pooled connection.
            LockScope::Transaction => {
                let session = inner
                    .session(deadline)
                    .await
                    .map_err(|error| inner.setup_failed_with(error))?;
                inner
                    .round_trip(session.simple_query("SELECT 1"))
                    .await
                    .map_err(|error| inner.setup_failed(error))?;
                session.give_back();
            }
        }
        inner
            .prepare_fencing(Instant::now() + inner.settings.timing.command_timeout)
            .await
            .map_err(|error| match error {
                LockError::Backend(error)
                    if error
                        .downcast_ref::<PgError>()
                        .is_some_and(|error| error.what == UNSAFE_SEQUENCE) =>
                {
                    SetupError::Unsafe(error.to_string())
                }
                error => inner.setup_failed_with(error),
            })?;
        inner
            .probe_client_check(Instant::now() + inner.settings.timing.command_timeout)
            .await
            .map_err(|error| inner.setup_failed_with(error))?;
        inner.reached.mark();
        Ok(backend)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_name_hosts_and_ports_never_credentials() {
        let named = |config: &str| address(&config.parse().unwrap());
        assert_eq!(
            named("host=db.internal port=6432 user=app password=secret"),
            "db.internal:6432"
        );
        assert_eq!(named("host=db user=app"), "db:5432");
        assert_eq!(
            named("postgresql://app:secret@10.0.0.1:6543/app"),
            "10.0.0.1:6543"
        );
        assert_eq!(named("host=a,b port=1,2"), "a:1, b:2");
        assert_eq!(named("host=::1 port=7"), "[::1]:7");
        assert_eq!(
            named("host=/run/postgresql port=5433"),
            "/run/postgresql/.s.PGSQL.5433"
        );
        assert!(!named("postgresql://app:secret@db/app").contains("secret"));
    }
}
