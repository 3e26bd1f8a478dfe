//! The health check answers truthfully and takes nothing.

use super::{instance, Deployment};
use crate::backend::{HEALTH_LOCK_NAME, HEALTH_PROBE_KEY};

/// A reachable engine is healthy, with a round trip and no error; checks from several
/// instances at once all answer; the probe key is free again after them, and no
/// check takes a key of the application.
pub async fn health_answers<D: Deployment>(deployment: &D) {
    let backends = [
        deployment.backend().await,
        deployment.backend().await,
        deployment.backend().await,
    ];
    let app = instance(deployment, "conformance-health").await;
    let held = app
        .lock("k")
        .await
        .expect("conformance: a free key is granted");
    // Started together: they race for the probe key.
    let checks: Vec<_> = backends
        .iter()
        .map(|backend| tokio::spawn(backend.health()))
        .collect();
    for check in checks {
        let health = check.await.expect("the health check panicked");
        assert!(
            health.is_healthy(),
            "conformance: a reachable engine's health check failed: {health}"
        );
        assert!(
            health.round_trip().is_some() && health.error().is_none(),
            "conformance: a healthy check has a round trip and no error: {health}"
        );
    }
    // Nothing the checks did is held any more, and they did not touch the app's key.
    let probe = instance(deployment, HEALTH_LOCK_NAME).await;
    let free = probe
        .try_lock(HEALTH_PROBE_KEY)
        .await
        .expect("conformance: the health check left its probe key held");
    free.release().await;
    assert!(
        !held.is_lost(),
        "conformance: a health check disturbed a held key"
    );
    held.release().await;
}
