//! What a MySQL or MariaDB deployment means for the locks, read for the deployment
//! check: the server and its version, and the server's clock. (A server where
//! `GET_LOCK` is not shared by every client, a Galera node, is refused when the backend
//! is built.)

use std::time::{Duration, SystemTime};

use mysql_async::Row;
use tokio::time::Instant;

use super::session::number;
use super::Inner;
use crate::backend::Finding;

/// The configuration findings of the server behind `inner`, read in one statement.
pub(super) async fn findings(inner: &Inner) -> Vec<Finding> {
    let sql = "SELECT VERSION(), CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)";
    let read = async {
        let mut session = inner
            .session(Instant::now() + inner.settings.timing.command_timeout)
            .await?;
        let sent_at = SystemTime::now();
        let started = Instant::now();
        let rows = session
            .rows(sql, inner.settings.timing.command_timeout)
            .await
            .map_err(|error| error.into_lock_error())?;
        let round_trip = started.elapsed();
        session.give_back();
        Ok::<_, crate::LockError>((rows, sent_at + round_trip / 2, round_trip / 2))
    };
    match read.await {
        Ok((rows, read_at, uncertainty)) => match rows.last().and_then(parse) {
            Some((version, micros)) => vec![
                Finding::pass(
                    "server",
                    version,
                    "GET_LOCK must be shared by every client of the server: a Galera node, which keeps it to itself, was refused when the backend was built",
                ),
                Finding::clock_offset(
                    SystemTime::UNIX_EPOCH + Duration::from_micros(micros),
                    read_at,
                    uncertainty,
                ),
            ],
            None => vec![unread("an answer without a version and a time")],
        },
        Err(error) => vec![unread(&error.to_string())],
    }
}

fn parse(row: &Row) -> Option<(String, u64)> {
    let version = row.get_opt::<String, usize>(0)?.ok()?;
    let micros = u64::try_from(number(row, 1)?).ok()?;
    Some((version, micros))
}

fn unread(why: &str) -> Finding {
    Finding::warn(
        "server",
        format!("could not be read: {why}"),
        "the check could not tell",
        "check that the server answers; the error says why not",
    )
}
