//! Soak runs: two instances sharing one server under load, random disconnects and
//! faults (the server killed, stopped or frozen meanwhile), checking that no two handlers
//! ever hold one key at once: on Redis (`redis`), PostgreSQL (`postgres`) and DynamoDB
//! (`dynamodb`), and the replay layer over Redis and PostgreSQL (`replay`). One soak runs
//! at a time (`support::soak_turn`). Each sends requests for `SOAK_SECONDS` (default
//! 15) or until `SOAK_REQUESTS` are sent; `SOAK_SECONDS=0` lifts the time box (as
//! `scripts/test --long` does, with 100 000 requests). `REPLAY_SOAK_*` scale the
//! replay soaks.

#[path = "../support/mod.rs"]
mod support;

// `Soak` drives layers keyed by `PathParam`: the `axum` feature too.
#[cfg(feature = "axum")]
mod dynamodb;
#[cfg(feature = "axum")]
mod postgres;
#[cfg(feature = "axum")]
mod redis;
mod replay;
