//! What the backend checks of the server before its first lock, once per backend (again
//! after a failure, so a fixed setup is taken up without a restart): that `GET_LOCK` is
//! shared by every client of the server, and, with fencing, that the counter table
//! exists (created safely under concurrency, and quietly) and cannot regress.

use std::time::Duration;

use tokio::time::Instant;

use super::error::MyError;
use super::session::number;
use super::Inner;
use crate::locks::LockError;

/// What the first-use checks learned of the server.
#[derive(Clone, Copy, Debug)]
pub(super) struct Server {
    /// MariaDB waits fractions of a second in `GET_LOCK`; MySQL takes the timeout as
    /// whole seconds (a fraction would be rounded, possibly up).
    fractional_waits: bool,
}

impl Server {
    /// `GET_LOCK`'s timeout for the `remaining` wait, never longer than it: seconds
    /// with microseconds, rounded up to the microsecond, where the server takes
    /// fractions; else whole seconds, rounded down (the rest is polled).
    pub(super) fn wait_argument(self, remaining: Duration) -> String {
        if self.fractional_waits {
            let micros = remaining.as_nanos().div_ceil(1000);
            format!("{}.{:06}", micros / 1_000_000, micros % 1_000_000)
        } else {
            remaining.as_secs().to_string()
        }
    }
}

impl Inner {
    /// Runs the first-use checks (see the module docs of this file) unless they passed.
    pub(super) async fn prepare(&self, deadline: Instant) -> Result<Server, LockError> {
        self.checked
            .get_or_try_init(|| self.check_server(deadline))
            .await
            .copied()
    }

    async fn check_server(&self, deadline: Instant) -> Result<Server, LockError> {
        let mut session = self.session(deadline).await?;
        let limit = self.settings.timing.command_timeout;
        let rows = session
            .rows("SELECT VERSION() LIKE '%MariaDB%'", limit)
            .await?;
        let server = Server {
            fractional_waits: rows.first().and_then(|row| number(row, 0)) == Some(1),
        };
        // Galera replicates rows, not `GET_LOCK`: each node would grant the same name.
        let rows = session
            .rows("SHOW GLOBAL VARIABLES LIKE 'wsrep_on'", limit)
            .await?;
        let wsrep_on = rows
            .first()
            .and_then(|row| row.get_opt::<String, usize>(1).and_then(Result::ok))
            .is_some_and(|value| value.eq_ignore_ascii_case("ON"));
        if wsrep_on {
            tracing::error!(
                "refusing a Galera cluster node (wsrep_on=ON): GET_LOCK is local to one node"
            );
            return Err(MyError::message(
                "refusing a Galera cluster node (wsrep_on=ON): GET_LOCK locks are local to \
                 one node, so two instances on two nodes would both hold a key; point the \
                 backend at one server (or one node through a proxy that always routes to it)",
            )
            .into());
        }
        if let Some(fencing) = &self.fencing {
            let table = &fencing.table;
            let (schema, name) = match table.split_once('.') {
                Some((schema, name)) => (format!("'{schema}'"), name),
                None => ("DATABASE()".to_owned(), &**table),
            };
            // Look first: nothing is sent that could warn when the table is there.
            let look = format!(
                "SELECT {schema} IS NULL, (SELECT ENGINE FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = {schema} AND TABLE_NAME = '{name}')"
            );
            let rows = session.rows(&look, limit).await?;
            let row = rows
                .first()
                .ok_or_else(|| MyError::message("MySQL answered no row"))?;
            if number(row, 0) == Some(1) {
                return Err(MyError::message(
                    "the fencing table has no database: name one in the connection URL \
                     (mysql://host/db) or qualify the table (fencing_table(\"db.table\"))",
                )
                .into());
            }
            let mut engine: Option<String> = row.get_opt(1).and_then(Result::ok).flatten();
            if engine.is_none() {
                // Creators of one table name take turns on its metadata lock, and the
                // loser's `IF NOT EXISTS` finds it made (a note, not an error): safe
                // with many instances starting at once.
                let create = format!(
                    "CREATE TABLE IF NOT EXISTS {table} (\
                     id TINYINT UNSIGNED NOT NULL PRIMARY KEY, \
                     token BIGINT UNSIGNED NOT NULL) ENGINE = InnoDB"
                );
                match session.rows(&create, limit).await {
                    Ok(_) => {}
                    // We may not create it; the look below tells whether it is there.
                    Err(error) if error.code == Some(1142) => {}
                    Err(error) => return Err(error.into()),
                }
                let rows = session.rows(&look, limit).await?;
                engine = rows
                    .first()
                    .and_then(|row| row.get_opt(1).and_then(Result::ok).flatten());
            }
            let engine = engine.ok_or_else(|| {
                MyError::message("the fencing table is missing and could not be created")
            })?;
            if !engine.eq_ignore_ascii_case("InnoDB") {
                tracing::error!(
                    table = &**table,
                    engine,
                    "refusing the fencing table: its counter could go backwards"
                );
                return Err(MyError::with_detail(
                    "refusing the fencing table: it must be InnoDB (a MEMORY table forgets \
                     its counter on restart, MyISAM or Aria may lose the last increments on \
                     a crash, so tokens could go backwards); ALTER TABLE ... ENGINE = InnoDB",
                    format!("{table} is {engine}"),
                )
                .into());
            }
            // 0 writes the log once a second: a server crash loses up to a second of
            // increments. 1 and 2 keep every committed increment across a server crash.
            let rows = session
                .rows("SELECT @@GLOBAL.innodb_flush_log_at_trx_commit", limit)
                .await?;
            if rows.first().and_then(|row| number(row, 0)) == Some(0) {
                tracing::error!("refusing innodb_flush_log_at_trx_commit=0: fencing tokens could go backwards after a crash");
                return Err(MyError::message(
                    "refusing innodb_flush_log_at_trx_commit = 0: a server crash loses the \
                     last second of fencing counter increments, so tokens could go \
                     backwards; set it to 1 (or 2), or turn fencing off",
                )
                .into());
            }
        }
        session.give_back();
        Ok(server)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_never_exceed_the_remaining_time() {
        let mariadb = Server {
            fractional_waits: true,
        };
        assert_eq!(mariadb.wait_argument(Duration::ZERO), "0.000000");
        assert_eq!(mariadb.wait_argument(Duration::from_nanos(1)), "0.000001");
        assert_eq!(
            mariadb.wait_argument(Duration::from_millis(2500)),
            "2.500000"
        );
        let mysql = Server {
            fractional_waits: false,
        };
        assert_eq!(mysql.wait_argument(Duration::from_millis(2999)), "2");
        assert_eq!(mysql.wait_argument(Duration::from_millis(300)), "0");
    }
}
