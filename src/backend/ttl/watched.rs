//! What a backend has seen of other holders' records, per key, and since when: the
//! clock of a takeover runs across acquisitions, so short waits that follow one another
//! still reach the end of a crashed holder's lease. For the engines whose records have
//! no expiry of their own (DynamoDB, S3): a record version unchanged for a lease, as
//! the waiter's own clock measures it, is a holder that stopped renewing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Another holder's record as an attempt found it: its version (rewritten at every
/// grant and renewal) and the lease its holder wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Version {
    pub(crate) version: String,
    pub(crate) lease: Duration,
}

/// The most keys remembered at once. A key beyond it is watched by each acquisition
/// alone again (a crashed holder is then taken over only by a wait of a whole lease);
/// about 150 bytes per key, so at most a few MiB.
const MAX_WATCHED: usize = 16_384;

/// A record version seen on another owner's item, and since when (on our monotonic
/// clock). If it is still the same a whole lease later, its holder stopped renewing.
struct Seen {
    version: String,
    since: Instant,
    lease: Duration,
}

impl Seen {
    fn stale_at(&self) -> Instant {
        self.since + self.lease
    }
}

/// The record versions seen per lock record (by its name at the engine), shared by
/// every acquisition of one backend.
#[derive(Default)]
pub(crate) struct Watched(Mutex<HashMap<String, Seen>>);

impl Watched {
    /// The version to take over at `now`: the one seen unchanged for a whole lease.
    pub(crate) fn stale_version(&self, item: &str, now: Instant) -> Option<String> {
        let seen = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        seen.get(item)
            .filter(|seen| now >= seen.stale_at())
            .map(|seen| seen.version.clone())
    }

    /// Notes what an attempt found on `item` (`None`: free again), answered at `now`;
    /// returns when the version seen goes stale, if it is held.
    ///
    /// A version's clock starts when this backend first sees it: its holder wrote it
    /// earlier, so the holder's own deadline (send time + lease − drift) passes before
    /// ours does.
    pub(crate) fn saw(&self, item: &str, holder: Option<Version>, now: Instant) -> Option<Instant> {
        let mut seen = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(holder) = holder else {
            seen.remove(item);
            return None;
        };
        if let Some(known) = seen
            .get(item)
            .filter(|known| known.version == holder.version)
        {
            return Some(known.stale_at());
        }
        let fresh = Seen {
            version: holder.version,
            since: now,
            lease: holder.lease,
        };
        let stale_at = fresh.stale_at();
        if seen.len() >= MAX_WATCHED && !seen.contains_key(item) {
            // Versions that went stale a lease ago and were not taken over: nobody
            // waits for those keys any more.
            seen.retain(|_, known| now < known.stale_at() + known.lease);
            if seen.len() >= MAX_WATCHED {
                return Some(stale_at);
            }
        }
        seen.insert(item.to_owned(), fresh);
        Some(stale_at)
    }

    /// Forgets `item`: this backend was just granted it.
    pub(crate) fn forget(&self, item: &str) {
        let mut seen = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        seen.remove(item);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(version: &str) -> Option<Version> {
        Some(Version {
            version: version.to_owned(),
            lease: Duration::from_secs(1),
        })
    }

    #[test]
    fn a_version_goes_stale_a_lease_after_it_was_first_seen() {
        let watched = Watched::default();
        let start = Instant::now();
        let second = Duration::from_secs(1);
        assert_eq!(watched.saw("k", holder("v1"), start), Some(start + second));
        // Seen again later, by another acquisition: the clock keeps running.
        let later = start + Duration::from_millis(600);
        assert_eq!(watched.saw("k", holder("v1"), later), Some(start + second));
        assert_eq!(watched.stale_version("k", later), None);
        assert_eq!(
            watched.stale_version("k", start + second).as_deref(),
            Some("v1")
        );
        // A renewal wrote a new version: its clock starts anew.
        assert_eq!(watched.saw("k", holder("v2"), later), Some(later + second));
        assert_eq!(watched.stale_version("k", start + second), None);
        // Free again, or ours: nothing is remembered.
        watched.saw("k", None, later);
        assert_eq!(watched.len(), 0);
        watched.saw("k", holder("v3"), later);
        watched.forget("k");
        assert_eq!(watched.len(), 0);
    }

    #[test]
    fn the_memory_is_bounded_and_drops_versions_nobody_took_over() {
        let watched = Watched::default();
        let start = Instant::now();
        for n in 0..MAX_WATCHED {
            watched.saw(&n.to_string(), holder("v"), start);
        }
        assert_eq!(watched.len(), MAX_WATCHED);
        // Full, and nothing is old: a new key is not remembered.
        assert!(watched.saw("new", holder("v"), start).is_some());
        assert_eq!(watched.len(), MAX_WATCHED);
        assert_eq!(
            watched.stale_version("new", start + Duration::from_secs(5)),
            None
        );
        // Two leases on, the old versions make room.
        let later = start + Duration::from_secs(2);
        watched.saw("new", holder("v"), later);
        assert_eq!(watched.len(), 1);
    }
}
