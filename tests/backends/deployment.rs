//! The deployment check (`DistributedLocks::check_deployment`) on servers set up
//! wrong, one finding each: the check must name what it saw and fail or warn. (On
//! servers set up right, the conformance check `the_deployment_live_run_passes` runs it on
//! every engine.)
#![cfg(feature = "redis")]

use std::time::Duration;

use tower_keyed_lock::backend::redis::RedisBackendBuilder;
use tower_keyed_lock::backend::{DeploymentReport, Verdict};
use tower_keyed_lock::{DistributedLocks, RedisBackend};

use crate::support::redis_server::RedisServer;

/// A fresh server's restart guard holds grants for a lease: a short one keeps the
/// live run within its wait.
fn builder(redis: &RedisServer) -> RedisBackendBuilder {
    RedisBackend::builder(redis.client()).lease(Duration::from_secs(1))
}

async fn check(backend: RedisBackend) -> DeploymentReport {
    DistributedLocks::new("deployment", backend)
        .check_deployment()
        .await
}

/// Asserts that `check` has `verdict` and that what it saw mentions `saw`; returns the
/// report's text for more.
fn assert_finding(report: &DeploymentReport, check: &str, verdict: Verdict, saw: &str) {
    let finding = report
        .finding(check)
        .unwrap_or_else(|| panic!("no {check} finding in:\n{report}"));
    assert_eq!(finding.verdict, verdict, "{check}:\n{report}");
    assert!(
        finding.saw.contains(saw),
        "{check} should mention {saw:?}:\n{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_fails_the_check() {
    let redis = RedisServer::start_with_args(&["--maxmemory-policy", "allkeys-lru"]);
    let backend = builder(&redis)
        .allow_unsafe_eviction_policy(true)
        .build()
        .await
        .expect("built with the opt-in");
    let report = check(backend).await;
    assert_finding(&report, "eviction_policy", Verdict::Fail, "allkeys-lru");
    assert!(!report.is_safe(), "{report}");
    // The live run still ran: the locks themselves work.
    assert_finding(&report, "exclusion", Verdict::Pass, "refused");
    let json = report.to_json();
    assert!(json.contains(r#""verdict":"fail""#), "{json}");
    assert!(
        json.contains("noeviction"),
        "the fix is in the JSON: {json}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_without_persistence_or_restart_guard_fails_the_check() {
    let redis = RedisServer::start_with_args(&["--appendonly", "no", "--save", ""]);
    let unguarded = builder(&redis).restart_guard(false).build().await.unwrap();
    let report = check(unguarded).await;
    assert_finding(&report, "persistence", Verdict::Fail, "appendonly no");
    // With the guard (the default), a restart cannot grant a held lock again.
    let guarded = builder(&redis).build().await.unwrap();
    let report = check(guarded).await;
    assert_finding(&report, "persistence", Verdict::Pass, "appendonly no");
    assert!(report.is_safe(), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_with_an_unawaited_replica_is_a_warning() {
    let primary = RedisServer::start();
    let replica = RedisServer::start_replica_of(&primary);
    let backend = builder(&primary).build().await.unwrap();
    let report = check(backend).await;
    assert_finding(&report, "replicas", Verdict::Warn, "1 connected replica");
    assert!(report.is_safe(), "a warning is not a failure:\n{report}");
    // Pointed at the replica itself: nothing can be granted.
    let on_replica = builder(&replica).build().await.unwrap();
    let report = check(on_replica).await;
    assert_finding(&report, "replicas", Verdict::Fail, "role slave");
    assert_finding(&report, "round_trip", Verdict::Fail, "not granted");
}
