//! The backend's error: what failed, with the PostgreSQL or pool error behind it.

use std::error::Error;
use std::fmt;

use tokio_postgres::error::SqlState;

use crate::locks::LockError;

/// A backend failure: what failed, and the PostgreSQL or pool error behind it.
#[derive(Debug)]
pub(super) struct PgError {
    what: &'static str,
    pub(super) code: Option<SqlState>,
    /// Whether the connection was found closed.
    pub(super) closed: bool,
    source: Option<Box<dyn Error + Send + Sync>>,
}

impl PgError {
    pub(super) fn new(what: &'static str, source: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        let source = source.into();
        let (code, closed) = match source.downcast_ref::<tokio_postgres::Error>() {
            Some(error) => (error.code().cloned(), error.is_closed()),
            None => (None, false),
        };
        Self {
            what,
            code,
            closed,
            source: Some(source),
        }
    }

    pub(super) fn message(what: &'static str) -> Self {
        Self {
            what,
            code: None,
            closed: false,
            source: None,
        }
    }

    pub(super) fn into_lock_error(self) -> LockError {
        LockError::Backend(Box::new(self))
    }
}

impl fmt::Display for PgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{}: {source}", self.what),
            None => f.write_str(self.what),
        }
    }
}

impl Error for PgError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}
