//! The fault proxy, compiled from the testkit's source into the test tree: the tests of
//! each engine use it whether or not the `testkit` feature is on.

#[path = "../../src/testkit/proxy.rs"]
mod source;

// Not every test binary that includes the support tree uses it.
#[allow(unused_imports)]
pub use source::FaultProxy as TcpProxy;
