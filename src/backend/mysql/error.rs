//! The backend's error: what failed, with the driver error behind it.

use std::borrow::Cow;
use std::error::Error;
use std::fmt;

use crate::locks::LockError;

/// Why a `GET_LOCK` cannot work through a proxy that multiplexes sessions, for errors
/// and logs.
pub(super) const SHARED_SESSION: &str = "the MySQL session is shared with other clients \
    (CONNECTION_ID() changed between statements of one connection, the session already \
    held this lock, or its lock was gone right after the grant): a proxy that multiplexes \
    sessions (ProxySQL with multiplexing, a transaction-level pooler) is in between. \
    GET_LOCK needs a direct connection, or a proxy that pins one server session to each \
    client connection";

/// A backend failure: what failed, and the driver error behind it.
#[derive(Debug)]
pub(super) struct MyError {
    what: Cow<'static, str>,
    /// The server's error code, if the server answered with an error.
    pub(super) code: Option<u16>,
    source: Option<Box<dyn Error + Send + Sync>>,
}

impl MyError {
    pub(super) fn new(what: impl Into<Cow<'static, str>>, source: mysql_async::Error) -> Self {
        let code = match &source {
            mysql_async::Error::Server(error) => Some(error.code),
            _ => None,
        };
        Self {
            what: what.into(),
            code,
            source: Some(Box::new(source)),
        }
    }

    pub(super) fn message(what: impl Into<Cow<'static, str>>) -> Self {
        Self {
            what: what.into(),
            code: None,
            source: None,
        }
    }

    pub(super) fn with_detail(what: impl Into<Cow<'static, str>>, detail: String) -> Self {
        Self {
            what: what.into(),
            code: None,
            source: Some(detail.into()),
        }
    }

    /// A multiplexing proxy shares server sessions.
    pub(super) fn shared_session() -> Self {
        tracing::error!("{SHARED_SESSION}");
        Self::message(SHARED_SESSION)
    }

    pub(super) fn into_lock_error(self) -> LockError {
        LockError::Backend(Box::new(self))
    }
}

impl From<MyError> for LockError {
    fn from(error: MyError) -> Self {
        error.into_lock_error()
    }
}

impl fmt::Display for MyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{}: {source}", self.what),
            None => f.write_str(&self.what),
        }
    }
}

impl Error for MyError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}
