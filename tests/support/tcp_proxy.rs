//! The fault proxy the testkit's fault checks use, under the name the tests know.

// Not every test binary that includes the support tree uses it.
#[allow(unused_imports)]
pub use tower_keyed_lock::testkit::FaultProxy as TcpProxy;
