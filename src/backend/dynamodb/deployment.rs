//! What a DynamoDB deployment means for the locks, read for the deployment check: the
//! lock table's TTL, and DynamoDB's clock as the `Date` of its answers tells it. (The
//! table's key schema is checked when the backend is built.)

use super::{table, Inner};
use crate::backend::Finding;

/// The configuration findings of the lock table behind `inner`.
pub(super) async fn findings(inner: &Inner) -> Vec<Finding> {
    let layout = &inner.layout;
    let limit = inner.config.settings.command_timeout;
    let read = table::time_to_live(&inner.client, &inner.endpoint, layout, limit).await;
    let clock = crate::backend::deployment::clock_offset_seen(&inner.endpoint.clock);
    let (attribute, status) = match read {
        Ok(read) => read,
        Err(error) => {
            return vec![clock, Finding::warn(
            "time_to_live",
            format!("could not be read: {error}"),
            "the check could not tell",
            "allow dynamodb:DescribeTimeToLive on the lock table, or check that DynamoDB answers",
        )]
        }
    };
    let wanted = &layout.ttl_attribute;
    let saw = format!(
        "table {}: TTL {status} on {}",
        layout.table,
        attribute.as_deref().unwrap_or("no attribute")
    );
    const WHY: &str = "a released key's item is deleted at its release, but a holder that \
        crashed leaves its item behind: only DynamoDB's TTL removes it, so without it the \
        table grows with every crash";
    let on_ours = attribute.as_deref() == Some(wanted.as_str());
    let time_to_live = match on_ours && (status == "ENABLED" || status == "ENABLING") {
        true => Finding::pass("time_to_live", saw, WHY),
        false => Finding::warn(
            "time_to_live",
            saw,
            WHY,
            format!("turn TTL on for attribute {wanted} (aws dynamodb update-time-to-live --table-name {} --time-to-live-specification Enabled=true,AttributeName={wanted})", layout.table),
        ),
    };
    vec![time_to_live, clock]
}
