//! What every built-in engine's `impl LockBackend` answers the same way, written once.

// Unused when no engine's feature is on.
#![allow(unused_macros, unused_imports)]

/// The head of a built-in engine's `impl LockBackend`, expanded inside it: for a backend
/// whose clones share their state as `self.inner` (an `Arc`).
///
/// - `engine_head!("etcd")` gives [`engine`](crate::LockBackend::engine), the name for
///   spans and logs, and [`identity`](crate::LockBackend::identity), that shared state
///   (clones are one backend);
/// - `engine_head!("etcd", findings = deployment::findings)` also gives
///   [`check_configuration`](crate::LockBackend::check_configuration), from an
///   `async fn(&Inner) -> Vec<Finding>` run on a clone of the shared state.
macro_rules! engine_head {
    ($engine:literal) => {
        /// Clones share one client: one backend.
        fn identity(&self) -> Option<$crate::backend::BackendIdentity> {
            Some($crate::backend::BackendIdentity::of(&self.inner))
        }

        fn engine(&self) -> &'static str {
            $engine
        }
    };
    ($engine:literal, findings = $findings:path) => {
        $crate::backend::engine_head::engine_head!($engine);

        fn check_configuration(&self) -> $crate::backend::BoxFuture<Vec<$crate::backend::Finding>> {
            let inner = self.inner.clone();
            Box::pin(async move { $findings(&inner).await })
        }
    };
}

pub(crate) use engine_head;
