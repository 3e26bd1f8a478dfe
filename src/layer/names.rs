//! The names layers hold on their backends (DESIGN rule 14): a layer's lock namespace
//! does not change with `.backend(..)`. Two layer values never exclude each other in
//! process (each has its own table), so two layers under one name on one backend —
//! which would exclude each other through it — are refused when the second is applied.
//! Clones of one layer value share its table, and so its claim: one layer value on many
//! routes is one layer. A claim ends when the layer's table is dropped.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::backend::BackendIdentity;

/// A name on a backend.
type Place = (BackendIdentity, Cow<'static, str>);

/// The names claimed now, by backend, with how the claiming layer holds its keys
/// (for the refusal's message).
static CLAIMED: Mutex<Option<HashMap<Place, String>>> = Mutex::new(None);

/// One layer table's hold on its name at its backend; dropped with the table.
#[derive(Debug)]
pub(crate) struct NameClaim {
    key: Place,
}

impl NameClaim {
    /// Claims `name` on the backend `identity` for a layer that holds its keys `mode`
    /// (such as "exclusively" or "with 2 permits").
    ///
    /// # Panics
    /// If another live layer holds `name` on that backend, naming both modes and the
    /// fix.
    pub(crate) fn claim(identity: BackendIdentity, name: Cow<'static, str>, mode: String) -> Self {
        let key = (identity, name);
        let taken = {
            let mut claimed = CLAIMED.lock().unwrap_or_else(PoisonError::into_inner);
            let claimed = claimed.get_or_insert_with(HashMap::new);
            match claimed.get(&key) {
                Some(other) => Some(other.clone()),
                None => {
                    claimed.insert(key.clone(), mode.clone());
                    None
                }
            }
        };
        // Panicking after the map's lock is released: nothing is poisoned.
        if let Some(other) = taken {
            panic!(
                "KeyedLockLayer: another layer (holding its keys {other}) already has the \
                 name \"{}\" on this backend; this one holds them {mode}. Two layers \
                 never exclude each other in process, so they must not through the \
                 backend either: give each layer its own `.name(..)` (clones of one \
                 layer value share its table and may be applied to many routes)",
                key.1
            );
        }
        Self { key }
    }
}

impl Drop for NameClaim {
    fn drop(&mut self) {
        let mut claimed = CLAIMED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(claimed) = claimed.as_mut() {
            claimed.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_name_is_claimed_once_per_backend_until_dropped() {
        let (one, two) = (Arc::new(1), Arc::new(2));
        let (one, two) = (BackendIdentity::of(&one), BackendIdentity::of(&two));
        let name = Cow::Borrowed("names-test");
        let first = NameClaim::claim(one, name.clone(), "exclusively".into());
        let _elsewhere = NameClaim::claim(two, name.clone(), "exclusively".into());
        let refused = std::panic::catch_unwind(|| {
            NameClaim::claim(one, name.clone(), "with 2 permits".into());
        });
        let message = *refused.unwrap_err().downcast::<String>().unwrap();
        assert!(
            message.contains("(holding its keys exclusively)"),
            "{message}"
        );
        assert!(
            message.contains("this one holds them with 2 permits"),
            "{message}"
        );
        assert!(message.contains("own `.name(..)`"), "{message}");
        drop(first);
        let _again = NameClaim::claim(one, name.clone(), "exclusively".into());
    }
}
