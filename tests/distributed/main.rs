//! `DistributedLocks` between instances, every test body generic over the fixtures of
//! `support::fixtures` (Redis, a Redis Cluster, PostgreSQL, DynamoDB, in process):
//! exclusion and hand-over (`instances`), an acquisition dropped at each of its awaits
//! (`cancel`), leader election (`leader`), the way jobs, workers and caches use it (`jobs`), work that stops when
//! its lease is lost (`lease`), shared locks (`shared`), several keys at once (`all`) and
//! the metrics and spans `DistributedLocks` records (`metrics`, `trace`), graceful
//! shutdown (`shutdown`) and layer names at a backend (`names`).

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod all;
mod cancel;
mod instances;
mod jobs;
mod leader;
mod lease;
mod metrics;
#[cfg(feature = "axum")]
mod names;
mod shared;
mod shutdown;
mod trace;
