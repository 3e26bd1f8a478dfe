//! The lock table: checking that it fits the configured layout, and creating it for
//! tests and local use.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, TableStatus,
    TimeToLiveSpecification,
};
use aws_sdk_dynamodb::Client;
use tokio::time::{sleep, timeout, Instant};

use super::item::Layout;
pub(super) use crate::backend::aws::Endpoint;
use crate::backend::SetupError;

use crate::backend::located::with_cause;

/// How long [`create_table`](super::DynamoDbBackendBuilder::create_table) waits for a
/// new table to become active.
const ACTIVE_WITHIN: Duration = Duration::from_secs(60);

/// How errors name the engine.
pub(super) const ENGINE: &str = "DynamoDB";

/// `client` with an [`Endpoint`] recorder added to its interceptors, and the recorder.
pub(super) fn record(client: &Client) -> (Client, Arc<Endpoint>) {
    let endpoint = Endpoint::new(client.config().region().map(|region| region.to_string()));
    let config = client
        .config()
        .to_builder()
        .interceptor(endpoint.interceptor())
        .build();
    (Client::from_conf(config), endpoint)
}

/// Runs one call within `limit`, mapping its error into a [`SetupError`] that names
/// `endpoint`.
async fn call<T, E>(
    endpoint: &Endpoint,
    limit: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, SetupError>
where
    aws_sdk_dynamodb::Error: From<E>,
{
    match timeout(limit, call).await {
        Ok(result) => result.map_err(|error| {
            let error = aws_sdk_dynamodb::Error::from(error);
            SetupError::failed(ENGINE, endpoint.describe(), with_cause(&error))
        }),
        Err(_) => Err(SetupError::no_answer(ENGINE, endpoint.describe(), limit)),
    }
}

/// Checks that the table exists with the layout's key schema: its partition key, and
/// its sort key if and only if one is configured.
pub(super) async fn check(
    client: &Client,
    endpoint: &Endpoint,
    layout: &Layout,
    limit: Duration,
) -> Result<(), SetupError> {
    let described = call(
        endpoint,
        limit,
        client.describe_table().table_name(&layout.table).send(),
    )
    .await?;
    let schema = described
        .table()
        .map(|table| table.key_schema())
        .unwrap_or_default();
    let key_named = |kind: KeyType| {
        schema
            .iter()
            .find(|element| *element.key_type() == kind)
            .map(|element| element.attribute_name())
    };
    let expected_sort = layout.sort_key.as_ref().map(|(name, _)| name.as_str());
    if key_named(KeyType::Hash) != Some(&*layout.partition_key)
        || key_named(KeyType::Range) != expected_sort
    {
        return Err(SetupError::Invalid(format!(
            "the lock table {:?} has key schema {schema:?}; expected partition key {:?} and sort key {expected_sort:?}",
            layout.table, layout.partition_key
        )));
    }
    Ok(())
}

/// The attribute the table's TTL is on and its status (`ENABLED`, `DISABLED`, …), as
/// `DescribeTimeToLive` says.
pub(super) async fn time_to_live(
    client: &Client,
    endpoint: &Endpoint,
    layout: &Layout,
    limit: Duration,
) -> Result<(Option<String>, String), SetupError> {
    let described = call(
        endpoint,
        limit,
        client
            .describe_time_to_live()
            .table_name(&layout.table)
            .send(),
    )
    .await?;
    let description = described.time_to_live_description();
    let attribute = description
        .and_then(|d| d.attribute_name())
        .map(str::to_owned);
    let status = description
        .and_then(|d| d.time_to_live_status())
        .map_or("DISABLED", |status| status.as_str());
    Ok((attribute, status.to_owned()))
}

/// Creates the table (on-demand capacity, string keys) unless it exists, waits until
/// it is active, and turns on its TTL attribute.
pub(super) async fn create(
    client: &Client,
    endpoint: &Endpoint,
    layout: &Layout,
    limit: Duration,
) -> Result<(), SetupError> {
    let mut keys = vec![(layout.partition_key.as_str(), KeyType::Hash)];
    if let Some((sort_key, _)) = &layout.sort_key {
        keys.push((sort_key.as_str(), KeyType::Range));
    }
    let mut create = client
        .create_table()
        .table_name(&layout.table)
        .billing_mode(BillingMode::PayPerRequest);
    for (name, kind) in keys {
        let definition = AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(|error| SetupError::Invalid(error.to_string()))?;
        let element = KeySchemaElement::builder()
            .attribute_name(name)
            .key_type(kind)
            .build()
            .map_err(|error| SetupError::Invalid(error.to_string()))?;
        create = create.attribute_definitions(definition).key_schema(element);
    }
    if let Err(error) = call(endpoint, limit, create.send()).await {
        // A table that exists already (made earlier, or by another instance) will do.
        if table_status(client, endpoint, layout, limit).await.is_err() {
            return Err(error);
        }
    }

    let give_up = Instant::now() + ACTIVE_WITHIN;
    while table_status(client, endpoint, layout, limit).await? != Some(TableStatus::Active) {
        if Instant::now() > give_up {
            return Err(SetupError::Invalid(format!(
                "the lock table {:?} not active within {ACTIVE_WITHIN:?}",
                layout.table
            )));
        }
        sleep(Duration::from_millis(200)).await;
    }

    let ttl = TimeToLiveSpecification::builder()
        .enabled(true)
        .attribute_name(&layout.ttl_attribute)
        .build()
        .map_err(|error| SetupError::Invalid(error.to_string()))?;
    let (enabled, _) = time_to_live(client, endpoint, layout, limit).await?;
    if enabled.as_deref() != Some(&*layout.ttl_attribute) {
        call(
            endpoint,
            limit,
            client
                .update_time_to_live()
                .table_name(&layout.table)
                .time_to_live_specification(ttl)
                .send(),
        )
        .await?;
    }
    Ok(())
}

async fn table_status(
    client: &Client,
    endpoint: &Endpoint,
    layout: &Layout,
    limit: Duration,
) -> Result<Option<TableStatus>, SetupError> {
    let described = call(
        endpoint,
        limit,
        client.describe_table().table_name(&layout.table).send(),
    )
    .await?;
    Ok(described
        .table()
        .and_then(|table| table.table_status())
        .cloned())
}
