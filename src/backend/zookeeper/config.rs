//! A ZooKeeper backend's settings, as its builder collects them (one file, so that the
//! session can read them without importing the backend that owns it).

use std::time::Duration;

#[derive(Clone, Debug)]
pub(super) struct Config {
    /// The connect string: `host:port,host:port,…`.
    pub(super) servers: String,
    pub(super) session_timeout: Duration,
    pub(super) drift: Option<Duration>,
    pub(super) command_timeout: Duration,
    pub(super) poll_interval: Duration,
    pub(super) prefix: String,
    /// The data of every contender node, for
    /// [`LockBackend::holder`](crate::LockBackend::holder).
    pub(super) instance_id: String,
}
