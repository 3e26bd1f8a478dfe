//! The lock table: checking that it fits the configured layout, and creating it for
//! tests and local use.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::config::interceptors::{
    BeforeDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::primitives::{DateTime, DateTimeFormat};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, TableStatus,
    TimeToLiveSpecification,
};
use aws_sdk_dynamodb::Client;
use aws_smithy_types::config_bag::{Storable, StoreReplace};
use tokio::time::{sleep, timeout, Instant};

use super::item::Layout;
use crate::backend::server_clock::ServerClock;
use crate::backend::SetupError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
use crate::backend::located::with_cause;

/// How long [`create_table`](super::DynamoDbBackendBuilder::create_table) waits for a
/// new table to become active.
const ACTIVE_WITHIN: Duration = Duration::from_secs(60);

/// How errors name the engine.
pub(super) const ENGINE: &str = "DynamoDB";

/// Where the client sends its requests, for errors: the scheme and host of the last
/// request it was about to send (the resolved endpoint: AWS's regional one, a local
/// DynamoDB, a proxy), read by an interceptor since the SDK's config does not tell it;
/// before any request, `region <name>`.
///
/// The same interceptor reads DynamoDB's clock from the `Date` of every answer.
#[derive(Debug)]
pub(super) struct Endpoint {
    seen: std::sync::Mutex<Option<String>>,
    region: Option<String>,
    pub(super) clock: ServerClock,
}

impl Endpoint {
    /// `client` with this recorder added to its interceptors, and the recorder.
    pub(super) fn record(client: &Client) -> (Client, Arc<Endpoint>) {
        let endpoint = Arc::new(Endpoint {
            seen: std::sync::Mutex::new(None),
            region: client.config().region().map(|region| region.to_string()),
            clock: ServerClock::default(),
        });
        let config = client
            .config()
            .to_builder()
            .interceptor(Recorder(endpoint.clone()))
            .build();
        (Client::from_conf(config), endpoint)
    }

    /// `scheme://host[:port]` of the last request, or the region before any.
    pub(super) fn describe(&self) -> String {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match (seen, &self.region) {
            (Some(endpoint), _) => endpoint,
            (None, Some(region)) => format!("region {region}"),
            (None, None) => "(no endpoint or region)".to_owned(),
        }
    }
}

/// The interceptor that fills an [`Endpoint`].
#[derive(Debug)]
struct Recorder(Arc<Endpoint>);

/// When a request's attempt went out, kept in its config bag until the answer.
#[derive(Clone, Copy, Debug)]
struct SentAt(tokio::time::Instant);

impl Storable for SentAt {
    type Storer = StoreReplace<Self>;
}

impl Intercept for Recorder {
    fn name(&self) -> &'static str {
        "tower_keyed_lock::EndpointRecorder"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        cfg.interceptor_state()
            .store_put(SentAt(tokio::time::Instant::now()));
        let uri = context.request().uri();
        // The scheme and authority only: never a path or a query.
        let end = uri
            .find("://")
            .map(|scheme| scheme + 3)
            .and_then(|start| uri[start..].find(['/', '?']).map(|end| start + end))
            .unwrap_or(uri.len());
        let authority = &uri[..end];
        // Credentials in the authority (`user:pass@host`) are left out.
        let authority = match (authority.find("://"), authority.rfind('@')) {
            (Some(scheme), Some(at)) => {
                format!("{}{}", &authority[..scheme + 3], &authority[at + 1..])
            }
            _ => authority.to_owned(),
        };
        let mut seen = self.0.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.as_deref() != Some(&*authority) {
            *seen = Some(authority);
        }
        Ok(())
    }

    fn read_before_deserialization(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let received = tokio::time::Instant::now();
        let date = context
            .response()
            .headers()
            .get("date")
            .and_then(|date| DateTime::from_str(date, DateTimeFormat::HttpDate).ok())
            .and_then(|date| u64::try_from(date.secs()).ok());
        if let (Some(secs), Some(SentAt(sent))) = (date, cfg.load::<SentAt>()) {
            self.0.clock.observe(secs, *sent, received);
        }
        Ok(())
    }
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
