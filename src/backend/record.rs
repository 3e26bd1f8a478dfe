//! A replay record read in an acquisition's own round trip: when a completed request's
//! record is already stored, the key is not taken and the record comes back instead.

use super::Lease;
#[cfg(feature = "replay")]
use super::ReleaseSlot;

/// Where a replay record lives at the lock's engine, for an acquisition that looks for
/// it first ([`LockBackend::acquire_unless_recorded`](super::LockBackend::acquire_unless_recorded)).
///
/// Made by a replay store kept on the lock's own engine (the Redis replay store on its
/// `RedisBackend`); only that engine reads it. A backend outside the crate never gets
/// one it can read, and keeps the default: acquire, then the store is asked.
#[derive(Clone, Debug)]
pub struct RecordLookup {
    #[cfg_attr(
        not(all(feature = "replay", any(feature = "redis", feature = "postgres"))),
        allow(dead_code)
    )]
    pub(crate) place: Place,
}

/// The engine-specific place of a record.
#[derive(Clone, Debug)]
pub(crate) enum Place {
    /// A key beside the lock's keys, on the server of the backend whose `Inner` sits at
    /// `engine` (the store and the lock must share one server: a lookup made for
    /// another backend is not read).
    #[cfg(all(feature = "replay", feature = "redis"))]
    Redis { engine: usize, key: String },
    /// SQL that the backend whose `Inner` sits at `engine` runs in its own round trip
    /// (the store's table is in that backend's database): for a lookup, an expression
    /// whose value is the record's bytes or NULL, read by the try; for a
    /// [`RecordWrite`], the statement that writes the record, run before the unlock.
    #[cfg(all(feature = "replay", feature = "postgres"))]
    Postgres { engine: usize, sql: String },
}

/// A replay record to write in a lease's release, in the release's own round trip
/// ([`ReleaseLease::release_writing`](super::ReleaseLease::release_writing)).
///
/// Made by a replay store kept on the lock's own engine (the PostgreSQL replay store,
/// for leases of the `PostgresBackend` it is looked up by); only that engine's leases
/// read it, any other keeps the default: the record is written apart.
#[cfg(feature = "replay")]
#[derive(Debug)]
pub struct RecordWrite {
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) place: Place,
}

/// What an acquisition that looked for a replay record first ended with.
#[derive(Debug)]
pub enum Acquired {
    /// The key is held, and the record was not stored when it was granted (nor can it
    /// appear while the key is held: a record is written only by the key's holder).
    NotRecorded(Lease),
    /// The key is held; the record was not looked for with the grant (it came after a
    /// wait, in a statement that could not see a record written meanwhile): the
    /// caller asks the store.
    Granted(Lease),
    /// The record's stored bytes; the key was not taken.
    Recorded(Vec<u8>),
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl Acquired {
    /// The lease of an acquisition that looked for no record (an engine's plain
    /// `acquire`, written once over its lookup-aware one).
    pub(crate) fn into_lease(self) -> Result<Lease, crate::LockError> {
        match self {
            Acquired::NotRecorded(lease) | Acquired::Granted(lease) => Ok(lease),
            Acquired::Recorded(_) => Err(crate::LockError::Backend(
                "the lock's engine answered a replay record to an acquisition that looked \
                 for none"
                    .into(),
            )),
        }
    }

    /// The same, its lease marked contended if `contended` (an acquisition that was
    /// tried again), as contended as before otherwise.
    pub(crate) fn contended_if(self, contended: bool) -> Self {
        let mark = |lease: Lease| match contended {
            true => lease.with_contention(true),
            false => lease,
        };
        match self {
            Acquired::NotRecorded(lease) => Acquired::NotRecorded(mark(lease)),
            Acquired::Granted(lease) => Acquired::Granted(mark(lease)),
            recorded @ Acquired::Recorded(_) => recorded,
        }
    }
}

/// What a request's acquisition found of its replay record, handed to the replay layer
/// in the request's extensions.
#[cfg(feature = "replay")]
#[derive(Clone)]
pub(crate) enum RecordFound {
    /// Stored: its bytes. The key is held in this process only.
    Stored(Vec<u8>),
    /// None stored when the key was granted; the lease's release, which the store may
    /// give back with the record it writes.
    Absent(ReleaseSlot),
}
