//! A ZooKeeper backend's settings, as its builder collects them (one file, so that the
//! session can read them without importing the backend that owns it).

use crate::backend::settings::Settings;

#[derive(Clone, Debug)]
pub(super) struct Config {
    /// The connect string: `host:port,host:port,…`.
    pub(super) servers: String,
    /// The lease is the session timeout: asked, then as ZooKeeper granted it.
    pub(super) settings: Settings,
    /// The session timeout asked, before ZooKeeper granted one (for the deployment
    /// check: its bounds may have changed it).
    pub(super) asked: std::time::Duration,
}
