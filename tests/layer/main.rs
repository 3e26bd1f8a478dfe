//! The lock middleware through real servers, recorders and captured logs: HTTP behaviour
//! (`over_http`), routing and key extraction (`routing`), keys from the JSON body
//! (`json_body`), metrics and the long-hold
//! warning (`metrics`), hostile input and overload (`reliability`), shared methods
//! (`shared`), tracing spans (`trace`), the shutdown handle and health check
//! (`shutdown`). Counting allocations is `tests/allocations.rs`, a
//! process of its own.
// Every test here builds its layer with `by_path` or `PathParam`: the `axum` feature.
#![cfg(feature = "axum")]

#[path = "../support/mod.rs"]
mod support;

mod json_body;
mod metrics;
mod over_http;
mod reliability;
mod routing;
mod shared;
mod shutdown;
mod trace;
