//! [`LockMode`]: how a backend is asked to hold a key — alone, shared with other
//! readers, or as one of `n` permit holders.

use std::fmt;

/// How a key is held at a [`LockBackend`](super::LockBackend): what
/// [`acquire_mode`](super::LockBackend::acquire_mode) asks for, and what
/// [`supports`](super::LockBackend::supports) answers about.
///
/// ```
/// use tower_keyed_lock::backend::LockMode;
///
/// assert_eq!(LockMode::permits(1), LockMode::Exclusive); // one permit is the lock itself
/// assert_eq!(LockMode::permits(3), LockMode::Permit { of: 3 });
/// assert_eq!(LockMode::Shared.to_string(), "shared locks");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// One holder of the key at a time, across every instance (what
    /// [`acquire`](super::LockBackend::acquire) takes).
    Exclusive,
    /// Together with other shared holders, while no exclusive holder has the key; a
    /// waiting exclusive holder stops new shared ones from entering.
    Shared,
    /// One of at most `of` holders of the key at a time, across every instance;
    /// `of` is at least 2 (one permit is [`Exclusive`](Self::Exclusive)).
    Permit {
        /// The number of permits of each key.
        of: usize,
    },
}

impl LockMode {
    /// `Exclusive` for one permit, else `Permit { of: permits }`.
    ///
    /// # Panics
    /// If `permits` is 0.
    pub fn permits(permits: usize) -> Self {
        assert!(permits > 0, "permits must be at least 1");
        match permits {
            1 => Self::Exclusive,
            of => Self::Permit { of },
        }
    }
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exclusive => f.write_str("exclusive locks"),
            Self::Shared => f.write_str("shared locks"),
            Self::Permit { of } => write!(f, "{of} permits per key"),
        }
    }
}
