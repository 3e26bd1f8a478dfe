//! The settings both session backends' builders share — the prefix, the liveness
//! interval and the command timeout — and the checks of other settings both make.

use std::fmt;
use std::sync::Arc;

use super::Timing;

/// What both session backends keep of their builders' settings.
#[derive(Clone)]
pub(crate) struct Settings {
    /// The first part of every lock's name or id.
    pub(crate) prefix: Arc<str>,
    pub(crate) timing: Timing,
}

impl Settings {
    /// The engine's default `prefix`, with the default timing.
    pub(crate) fn new(prefix: &str) -> Self {
        Settings {
            prefix: prefix.into(),
            timing: Timing::default(),
        }
    }

    /// Adds the shared settings to a backend's or builder's `Debug`.
    pub(crate) fn debug_fields(&self, f: &mut fmt::DebugStruct<'_, '_>) {
        f.field("prefix", &self.prefix)
            .field("liveness_interval", &self.timing.liveness_interval)
            .field("command_timeout", &self.timing.command_timeout);
    }
}

/// Why a pool size is refused: zero connections could hold no lock.
pub(crate) fn refused_pool_size(max: usize) -> Option<String> {
    (max == 0).then(|| "max_connections must be at least 1".into())
}

/// Whether `name` is a plain or qualified (`schema.name`) name of unquoted identifiers
/// of at most `max_part` bytes each: safe to format into SQL as it is.
pub(crate) fn is_plain_or_qualified(name: &str, max_part: usize) -> bool {
    let valid_part = |part: &str| {
        !part.is_empty()
            && part.len() <= max_part
            && !part.starts_with(|c: char| c.is_ascii_digit())
            && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let parts: Vec<&str> = name.split('.').collect();
    parts.len() <= 2 && parts.iter().all(|part| valid_part(part))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_or_qualified_identifiers() {
        for good in ["tokens", "locks.tokens", "_a1", &"n".repeat(63)] {
            assert!(is_plain_or_qualified(good, 63), "{good:?} was refused");
        }
        for bad in [
            "",
            "a b",
            "x;drop",
            "a.b.c",
            "1abc",
            "a'b",
            "a`b",
            ".a",
            &"n".repeat(64),
        ] {
            assert!(!is_plain_or_qualified(bad, 63), "{bad:?} was accepted");
        }
    }
}
