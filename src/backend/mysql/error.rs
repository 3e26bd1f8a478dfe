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
    /// Whether another attempt on a fresh connection may succeed (see
    /// [`is_transient`]).
    transient: bool,
    source: Option<Box<dyn Error + Send + Sync>>,
}

/// The server's errors that end a session or refuse one in passing: too many
/// connections (1040), a shutdown (1053), a statement interrupted (1317, `KILL QUERY`),
/// a session killed (MariaDB 1927, MySQL 3169) or ended idle (MySQL 4031).
const PASSING: [u16; 6] = [1040, 1053, 1317, 1927, 3169, 4031];

impl MyError {
    pub(super) fn new(what: impl Into<Cow<'static, str>>, source: mysql_async::Error) -> Self {
        // Without a server's answer, the connection broke (a reset, a refused connect,
        // a closed socket): another one may work.
        let (code, transient) = match &source {
            mysql_async::Error::Server(error) => (Some(error.code), PASSING.contains(&error.code)),
            mysql_async::Error::Url(_) => (None, false),
            _ => (None, true),
        };
        Self {
            what: what.into(),
            code,
            transient,
            source: Some(Box::new(source)),
        }
    }

    pub(super) fn message(what: impl Into<Cow<'static, str>>) -> Self {
        Self {
            what: what.into(),
            code: None,
            transient: false,
            source: None,
        }
    }

    pub(super) fn with_detail(what: impl Into<Cow<'static, str>>, detail: String) -> Self {
        Self {
            source: Some(detail.into()),
            ..Self::message(what)
        }
    }

    /// A round trip (or a connect) that went unanswered within its limit.
    pub(super) fn unanswered(what: impl Into<Cow<'static, str>>) -> Self {
        Self {
            transient: true,
            ..Self::message(what)
        }
    }

    /// `what` went wrong because of `cause`, which tells whether it was in passing.
    pub(super) fn because(what: impl Into<Cow<'static, str>>, cause: MyError) -> Self {
        Self {
            what: what.into(),
            code: None,
            transient: cause.transient,
            source: Some(Box::new(cause)),
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

/// Whether an acquisition that failed with `error` may be granted by another attempt on
/// a fresh connection: the connection broke or went unanswered, or the server ended or
/// refused the session in passing. Not an answer, a refused login, a proxy that shares
/// sessions.
pub(super) fn is_transient(error: &LockError) -> bool {
    match error {
        LockError::Backend(error) => error
            .downcast_ref::<MyError>()
            .is_some_and(|error| error.transient),
        _ => false,
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
