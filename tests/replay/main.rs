//! The replay layer's semantics, the same rows (`support::replay`) run against each
//! store: in memory (`memory`, plus what only the layer decides), Redis (`redis`) and
//! PostgreSQL (`postgres`), each on a real server with the lock on the same server.

#[path = "../support/mod.rs"]
mod support;

mod memory;
mod postgres;
mod redis;
