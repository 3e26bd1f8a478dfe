//! The storage of a key's text: inline when short, shared when long.

use std::sync::Arc;

use arrayvec::ArrayString;

/// Keys up to this many bytes are stored inline: numeric ids, ULIDs (26) and UUIDs
/// (36) all fit, so taking such a key from a request, cloning it into the lock table
/// and into `LockInfo`, and dropping it again never allocates.
pub(crate) const INLINE_LEN: usize = 40;

/// A key's text. Cloning copies at most 48 bytes or bumps one reference count.
#[derive(Clone)]
pub(crate) enum Text {
    Inline(ArrayString<INLINE_LEN>),
    Shared(Arc<str>),
}

impl Text {
    pub(crate) fn new(s: &str) -> Self {
        match ArrayString::from(s) {
            Ok(inline) => Text::Inline(inline),
            Err(_) => Text::Shared(Arc::from(s)),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            Text::Inline(inline) => inline,
            Text::Shared(shared) => shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_text_is_inline_long_text_is_shared() {
        let uuid = "67e55044-10b1-426f-9247-bb680e5fe0c8";
        assert!(matches!(Text::new(uuid), Text::Inline(_)));
        assert!(matches!(
            Text::new(&"k".repeat(INLINE_LEN)),
            Text::Inline(_)
        ));
        let long = "k".repeat(INLINE_LEN + 1);
        assert!(matches!(Text::new(&long), Text::Shared(_)));
        assert_eq!(Text::new(&long).as_str(), long);
        assert_eq!(Text::new(uuid).as_str(), uuid);
    }

    #[test]
    fn stays_small() {
        assert!(std::mem::size_of::<Text>() <= 48);
    }
}
