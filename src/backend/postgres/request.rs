//! What one acquisition asks PostgreSQL for.

use tokio::time::Instant;

/// What an acquisition asks for, the same in each of its attempts.
#[derive(Clone, Copy)]
pub(super) struct Request<'a> {
    /// The session lock id (see `lock_id.rs`).
    pub(super) id: i64,
    /// Held beside other shared holders rather than alone.
    pub(super) shared: bool,
    /// A permit's key lock id, taken in shared mode with `id` (see `permits.rs`).
    pub(super) key: Option<i64>,
    /// The end of the wait.
    pub(super) deadline: Instant,
    /// An SQL expression of a replay record's bytes, or NULL: a stored record is
    /// answered instead of a grant (see `Inner::acquire_unless_recorded`).
    pub(super) record: Option<&'a str>,
}
