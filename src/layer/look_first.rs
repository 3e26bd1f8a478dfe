//! The look a layer stacked inside the lock takes before a request takes its key: the
//! replay layer's, for the request's stored response. A completed request then needs
//! no key, or the backend looks for its record in the acquisition's own round trip.
//! The lock layer knows only this hook; the `replay` module implements it.

use http::request::Parts;

use super::info::LayerName;
use crate::backend::RecordLookup;
use crate::key::Key;

/// What an exclusive request is looked up by before it takes `key` of the lock layer
/// `layer`; either look may leave what it named in the request's extensions.
pub(crate) trait LookFirst: Send + Sync + 'static {
    /// Where the remote acquisition looks for the request's record first; `None`: it
    /// does not.
    fn lookup(&self, parts: &mut Parts, layer: &LayerName, key: &Key) -> Option<RecordLookup>;

    /// Whether the request's record is in this process's memory already: then the
    /// request takes no key.
    fn found_in_memory(&self, parts: &mut Parts, layer: &LayerName, key: &Key) -> bool;
}
