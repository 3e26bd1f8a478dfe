//! The distributed backends against real servers the tests start (the conformance
//! checks running at once share one per engine). First the
//! conformance suite (`conformance`: `tower_keyed_lock::testkit` run for every backend,
//! plus the fault and HTTP checks every backend passes); then each engine's specifics:
//! Redis (`redis`, `redis_cluster`, `redis_faults`, `redis_handoff`, `redis_sentinel`), PostgreSQL
//! (`postgres`, `postgres_faults`, `postgres_pgbouncer`), DynamoDB (`dynamodb`), etcd
//! (`etcd`), MySQL (`mysql`), Redlock (`redlock`), Azure Blob Storage on Azurite
//! (`azure_blob`), S3 on moto (`s3`), ZooKeeper (`zookeeper`); what engines of one family promise alike, one
//! body run on each (`queues`: etcd and ZooKeeper; `session_locks`: PostgreSQL and MySQL); the fault proxy they rely on (`tcp_proxy`); and the suite's renewal checks on a
//! stalled server (`renewal_check`). The Redis restart guard's logs are
//! `tests/redis_restart_guard.rs`, a process of its own.

#[path = "../support/mod.rs"]
mod support;

mod conformance;
mod modes_model;

mod azure_blob;
mod deployment;
mod etcd;
mod mysql;
// These go through the HTTP layer (`by_path`): the `axum` feature too.
#[cfg(feature = "axum")]
mod dynamodb;
#[cfg(feature = "axum")]
mod postgres;
mod postgres_faults;
mod postgres_pgbouncer;
mod queues;
#[cfg(feature = "axum")]
mod redis;
mod redis_cluster;
#[cfg(feature = "axum")]
mod redis_faults;
mod redis_handoff;
mod redis_sentinel;
mod redlock;
mod renewal_check;
mod s3;
mod session_locks;
mod tcp_proxy;
mod zookeeper;
