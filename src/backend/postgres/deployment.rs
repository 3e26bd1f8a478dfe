//! What a PostgreSQL deployment means for the locks, read for the deployment check:
//! the server's version, the lock scope against a pooler in between, and the server's
//! clock.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::error::PgError;
use super::session::last_row;
use super::{Inner, LockScope};
use crate::backend::Finding;
use crate::error::LockError;

/// The configuration findings of the server behind `inner`, read in one statement.
pub(super) async fn findings(inner: &Inner) -> Vec<Finding> {
    let mut findings = vec![scope(inner.scope)];
    match read(inner).await {
        Ok(read) => {
            findings.push(version(read.version));
            findings.push(Finding::clock_offset(
                read.server_time,
                read.read_at,
                read.uncertainty,
            ));
        }
        Err(error) => findings.push(Finding::warn(
            "server",
            format!("could not be read: {error}"),
            "the check could not tell",
            "check that PostgreSQL answers; the error says why not",
        )),
    }
    findings
}

fn scope(scope: LockScope) -> Finding {
    let saw = match scope {
        LockScope::Session => "session locks, each on a server session of its own (a pooler that shares sessions was ruled out when the backend was built)",
        LockScope::Transaction => "transaction locks, each in a transaction held open until its release",
    };
    Finding::pass(
        "lock_scope",
        saw,
        "a session lock shared with other clients through a transaction pooler would be \
         released, or granted to them, behind its holder's back: the backend refuses that \
         setup when built, and transaction locks work behind such a pooler",
    )
}

fn version(version_num: u32) -> Finding {
    let saw = format!(
        "PostgreSQL {}.{}",
        version_num / 10_000,
        version_num % 10_000
    );
    const WHY: &str = "the check that no transaction pooler shares a session lock's \
        session needs idle_session_timeout, new in PostgreSQL 14";
    match version_num >= 140_000 {
        true => Finding::pass("server_version", saw, WHY),
        false => Finding::warn(
            "server_version",
            saw,
            WHY,
            "upgrade to PostgreSQL 14 or newer, or make sure no transaction or statement pooler sits between this service and PostgreSQL",
        ),
    }
}

struct Read {
    version: u32,
    server_time: SystemTime,
    read_at: SystemTime,
    uncertainty: Duration,
}

async fn read(inner: &Inner) -> Result<Read, LockError> {
    let sql = "SELECT current_setting('server_version_num'), \
               (extract(epoch from clock_timestamp()) * 1000000)::bigint";
    let session = inner
        .session(Instant::now() + inner.settings.timing.command_timeout)
        .await?;
    let sent_at = SystemTime::now();
    let started = Instant::now();
    let answer = inner
        .round_trip(session.simple_query(sql))
        .await
        .map_err(PgError::into_lock_error)?;
    let round_trip = started.elapsed();
    session.give_back();
    let row = last_row(&answer).ok_or_else(|| LockError::Backend("no row".into()))?;
    let number = |column: usize| row.get(column).and_then(|text| text.parse::<u64>().ok());
    let (Some(version), Some(micros)) = (number(0), number(1)) else {
        return Err(LockError::Backend(
            "an answer that is not two numbers".into(),
        ));
    };
    Ok(Read {
        version: u32::try_from(version).unwrap_or(u32::MAX),
        server_time: SystemTime::UNIX_EPOCH + Duration::from_micros(micros),
        read_at: sent_at + round_trip / 2,
        uncertainty: round_trip / 2,
    })
}
