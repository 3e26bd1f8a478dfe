//! A request's replay record, named before its key is taken: the lock's remote
//! acquisition looks for it in its own round trip (see `LockBackend::acquire_unless_recorded`),
//! and a store in this process's memory is read at once, so a completed request is
//! replayed without taking the key.

use std::sync::Arc;

use bytes::Bytes;

use http::request::Parts;

use super::fingerprint::{Head, ScopeOf};
use super::record::Record;
use super::shared::Settings;
use super::store::{RecordKey, RecordPlace};
use crate::backend::RecordLookup;
use crate::key::Key;
use crate::layer::{LayerName, LookFirst};

/// Names a request's record for the lock layer; made by
/// [`KeyedLockLayer::replay`](crate::KeyedLockLayer::replay) when the store is kept on
/// the lock's engine or in this process's memory.
pub(crate) struct LookupFirst {
    settings: Arc<Settings>,
}

/// A record found in memory before the request took its key: the lock layer passes the
/// request on without the key, and the replay layer replays the record (or refuses the
/// request, if its fingerprint differs). A completed request changes nothing, so its
/// replay need not wait for whoever holds the key now. Small, as it goes through the
/// request's extensions: the lock layer's name (for the metrics), and the record and
/// request body the store holds.
#[derive(Clone)]
pub(crate) struct FoundInMemory {
    pub(crate) layer: LayerName,
    pub(crate) record: Arc<Record>,
    /// The body of the request that made the record, if the store kept it.
    pub(crate) request_body: Option<Bytes>,
}

impl LookupFirst {
    pub(crate) fn new(settings: Arc<Settings>) -> Self {
        Self { settings }
    }

    /// The request's record key; `None` without the principal the records are scoped
    /// by.
    fn name(&self, parts: &Parts, layer: &LayerName, key: &Key) -> Option<RecordKey> {
        let principal = self.principal(parts)?;
        Some(RecordKey::new(
            layer,
            key,
            Head::new(parts, principal.as_deref()),
        ))
    }

    /// The principal records are scoped by: `Some(None)` when they are not, `None` when
    /// the request carries none.
    fn principal(&self, parts: &Parts) -> Option<Option<String>> {
        match &self.settings.principal {
            Some(principal) => Some(Some(principal(&parts.extensions)?)),
            None => Some(None),
        }
    }
}

impl LookFirst for LookupFirst {
    /// Where the record of the request `parts`, under `key` of the layer `layer`, is
    /// looked for; its [`RecordKey`] goes into the request's extensions for the replay
    /// layer. `None` when the request has no principal to scope it by (the replay
    /// layer answers that) or the store cannot be read in the acquisition.
    fn lookup(&self, parts: &mut Parts, layer: &LayerName, key: &Key) -> Option<RecordLookup> {
        let record = self.name(parts, layer, key)?;
        let lookup = self.settings.store.lookup(&record)?;
        parts.extensions.insert(record);
        Some(lookup)
    }

    /// Whether the record of the request `parts` is in the memory store already: then
    /// it goes into the request's extensions as [`FoundInMemory`], and the request
    /// needs no key. If not, its [`RecordKey`] goes there, for the replay layer to
    /// look again once the key is held.
    fn found_in_memory(&self, parts: &mut Parts, layer: &LayerName, key: &Key) -> bool {
        let Some(memory) = &self.settings.memory else {
            return false;
        };
        let Some(principal) = self.principal(parts) else {
            return false;
        };
        let scope = ScopeOf::new(parts, principal.as_deref());
        match memory.find(&RecordPlace::new(layer, key, scope)) {
            Some(found) => {
                let found = FoundInMemory {
                    layer: layer.clone(),
                    record: found.record,
                    request_body: found.request_body,
                };
                parts.extensions.insert(found);
                true
            }
            None => {
                let name = RecordKey::new(layer, key, Head::new(parts, principal.as_deref()));
                parts.extensions.insert(name);
                false
            }
        }
    }
}
