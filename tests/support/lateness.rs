//! How late this process wakes its timers: the testkit's [`Lateness`].

// Not every test binary that includes the support tree uses it.
#[allow(unused_imports)]
pub use tower_keyed_lock::testkit::Lateness;
