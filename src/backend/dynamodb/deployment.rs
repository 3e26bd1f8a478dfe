//! What a DynamoDB deployment means for the locks, read for the deployment check: the
//! lock table's TTL. (Its key schema is checked when the backend is built.)

use super::{table, Inner};
use crate::backend::Finding;

/// The configuration findings of the lock table behind `inner`.
pub(super) async fn findings(inner: &Inner) -> Vec<Finding> {
    let layout = &inner.layout;
    let limit = inner.config.settings.command_timeout;
    let read = table::time_to_live(&inner.client, &inner.endpoint, layout, limit).await;
    let (attribute, status) = match read {
        Ok(read) => read,
        Err(error) => return vec![Finding::warn(
            "time_to_live",
            format!("could not be read: {error}"),
            "the check could not tell",
            "allow dynamodb:DescribeTimeToLive on the lock table, or check that DynamoDB answers",
        )],
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
    match on_ours && (status == "ENABLED" || status == "ENABLING") {
        true => vec![Finding::pass("time_to_live", saw, WHY)],
        false => vec![Finding::warn(
            "time_to_live",
            saw,
            WHY,
            format!("turn TTL on for attribute {wanted} (aws dynamodb update-time-to-live --table-name {} --time-to-live-specification Enabled=true,AttributeName={wanted})", layout.table),
        )],
    }
}
