//! The distributed backends against real servers each test starts. First the
//! conformance suite (`conformance`: `tower_keyed_lock::testkit` run for every backend,
//! plus the fault and HTTP checks every backend passes); then each engine's specifics:
//! Redis (`redis`, `redis_cluster`, `redis_faults`, `redis_sentinel`), PostgreSQL
//! (`postgres`, `postgres_faults`, `postgres_pgbouncer`), DynamoDB (`dynamodb`); and
//! the fault proxy they rely on (`tcp_proxy`). The Redis restart guard's logs are
//! `tests/redis_restart_guard.rs`, a process of its own.

#[path = "../support/mod.rs"]
mod support;

mod conformance;

mod dynamodb;
mod postgres;
mod postgres_faults;
mod postgres_pgbouncer;
mod redis;
mod redis_cluster;
mod redis_faults;
mod redis_sentinel;
mod tcp_proxy;
