//! N permits per key: `n` session advisory locks per key, one per permit, tried in
//! turn; a holder holds one of them, as it would hold the key alone, and the key's own
//! lock in shared mode beside it, taken first in the same statement (both or neither).
//! So a writer of the key (an instance configured exclusive under the same name, in
//! another process where the mismatch cannot be refused when built), which takes the
//! key's lock exclusively, and permit holders exclude each other; permit holders, like
//! readers, do not wait behind each other on the key's lock, and a waiting writer keeps
//! new ones out (PostgreSQL refuses a try that conflicts with a queued request). Each
//! acquirer counts against its own `n`: its own `n` lock ids, so instances configured
//! with different `n` under one name share the key's lock against writers but not
//! their permits (up to the sum of their `n` hold at once).
//!
//! PostgreSQL queues a waiter on one lock id, not on "any of n": so a permit waiter
//! tries every id once (`pg_try_advisory_lock`, one round trip each), then sleeps a
//! jittered [`PERMIT_POLL`] and tries again, until its wait is over. Waiters of a full
//! key are served in no particular order.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::{lock_id, Inner};
use crate::backend::backoff::random;
use crate::backend::Lease;
use crate::error::LockError;

/// How long a permit waiter sleeps between rounds of tries: between half of it and all
/// of it, cut to the end of the wait.
pub const PERMIT_POLL: Duration = Duration::from_millis(100);

/// The lock ids of the `permits` permits of `key` for the locks named `name`: distinct
/// from the key's own lock id (the prefix gains a NUL and the permit's place).
pub(super) fn permit_ids(prefix: &str, name: &str, key: &str, permits: usize) -> Vec<i64> {
    (0..permits)
        .map(|place| lock_id(&format!("{prefix}\0permit {place} of {permits}"), name, key))
        .collect()
}

impl Inner {
    /// Holds one of the locks `ids` (tried from a random place, so instances spread
    /// over them) and `key`, the key's lock id, in shared mode, waiting until
    /// `deadline`.
    pub(super) async fn acquire_permit(
        self: Arc<Self>,
        key: i64,
        ids: Vec<i64>,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let start = usize::try_from(random() % ids.len() as u64).unwrap_or(0);
        loop {
            for place in 0..ids.len() {
                let id = ids[(start + place) % ids.len()];
                // A try: no wait in PostgreSQL's queue for this one id.
                match self
                    .clone()
                    .acquire(id, false, Some(key), Instant::now())
                    .await
                {
                    Ok(lease) => return Ok(lease),
                    Err(LockError::Timeout) => {}
                    Err(error) => return Err(error),
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(LockError::Timeout);
            }
            let half = PERMIT_POLL / 2;
            let jitter = Duration::from_micros(random() % half.as_micros() as u64);
            sleep((half + jitter).min(deadline - now)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permit_ids_are_distinct_from_each_other_and_the_key() {
        let ids = permit_ids("ns", "exports", "tenant-1", 3);
        let mut all = ids.clone();
        all.push(lock_id("ns", "exports", "tenant-1"));
        all.extend(permit_ids("ns", "exports", "tenant-1", 2));
        let count = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), count);
    }
}
