//! What an Azure Blob deployment means for the locks, for the deployment check: the
//! container and the lease period, and Azure's clock as the `Date` of its answers
//! tells it. (A container that is missing is made when the backend is built.)

use super::Inner;
use crate::backend::deployment::clock_offset_seen;
use crate::backend::Finding;

/// The configuration findings of the container behind `inner`.
pub(super) fn findings(inner: &Inner) -> Vec<Finding> {
    let lease = Finding::pass(
        "lease_period",
        format!(
            "blob leases of {} s in container {}",
            inner.lease_secs, inner.address
        ),
        "Azure frees a crashed holder's blob lease when its period ends (15 to 60 s, or never \
         for an infinite lease, which the backend never asks for); renewal keeps a live \
         holder's",
    );
    vec![lease, clock_offset_seen(&inner.clock)]
}
