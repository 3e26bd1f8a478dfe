//! The deployment check (`DistributedLocks::check_deployment`) on servers set up
//! wrong, one finding each: the check must name what it saw and fail or warn. (On
//! servers set up right, the conformance check `the_deployment_live_run_passes` runs it on
//! every engine.)
#![cfg_attr(
    not(any(
        feature = "redis",
        feature = "postgres",
        feature = "dynamodb",
        feature = "etcd",
        feature = "mysql",
        feature = "azure-blob",
        feature = "zookeeper"
    )),
    allow(dead_code)
)]

use tower_keyed_lock::backend::{DeploymentReport, LockBackend, Verdict};
use tower_keyed_lock::DistributedLocks;

async fn check(backend: impl LockBackend) -> DeploymentReport {
    DistributedLocks::new("deployment", backend)
        .check_deployment()
        .await
}

/// Asserts that `check` has `verdict` and that what it saw mentions `saw`.
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

#[cfg(feature = "redis")]
mod redis {
    use std::time::Duration;

    use tower_keyed_lock::backend::redis::RedisBackendBuilder;
    use tower_keyed_lock::backend::Verdict;
    use tower_keyed_lock::RedisBackend;

    use super::{assert_finding, check};
    use crate::support::redis_server::RedisServer;

    /// A fresh server's restart guard holds grants for a lease: a short one keeps the
    /// live run within its wait.
    fn builder(redis: &RedisServer) -> RedisBackendBuilder {
        RedisBackend::builder(redis.client()).lease(Duration::from_secs(1))
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
}

#[cfg(feature = "redis")]
mod redlock {
    use std::time::Duration;

    use tower_keyed_lock::backend::redlock::RedlockBackend;
    use tower_keyed_lock::backend::Verdict;

    use super::check;
    use crate::support::redis_server::RedisServer;

    /// One evicting master of three fails the check, named by its address; each
    /// master's clock is reported.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_evicting_master_is_named() {
        let masters = [
            RedisServer::start(),
            RedisServer::start_with_args(&["--maxmemory-policy", "volatile-lru"]),
            RedisServer::start(),
        ];
        let backend = RedlockBackend::builder(masters.iter().map(RedisServer::url))
            .lease(Duration::from_secs(1))
            .allow_unsafe_eviction_policy(true)
            .build()
            .await
            .unwrap();
        let report = check(backend).await;
        let evictions: Vec<_> = (report.findings().iter())
            .filter(|finding| finding.check == "eviction_policy")
            .collect();
        assert_eq!(evictions.len(), 3, "{report}");
        for (master, finding) in masters.iter().zip(&evictions) {
            let address = format!("127.0.0.1:{}", master.port());
            assert!(finding.saw.starts_with(&address), "{address}:\n{report}");
        }
        let verdicts: Vec<_> = evictions.iter().map(|finding| finding.verdict).collect();
        assert_eq!(
            verdicts,
            [Verdict::Pass, Verdict::Fail, Verdict::Pass],
            "{report}"
        );
        assert!(evictions[1].saw.contains("volatile-lru"), "{report}");
        let clocks = (report.findings().iter())
            .filter(|finding| finding.check == "clock_offset" && finding.verdict == Verdict::Pass)
            .count();
        assert_eq!(clocks, 3, "{report}");
        assert!(!report.is_safe(), "{report}");
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use tower_keyed_lock::backend::postgres::PostgresBackend;
    use tower_keyed_lock::backend::Verdict;

    use super::{assert_finding, check};
    use crate::support::pg_server::PgServer;

    /// `cargo run --example check_deployment -- <url> --json` on a working server:
    /// the report as JSON, and exit status 0. (The example is built with the tests.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_example_checks_a_url() {
        let pg = PgServer::start();
        let example = std::env::current_exe()
            .unwrap()
            .parent()
            .and_then(|deps| deps.parent())
            .map(|target| target.join("examples/check_deployment"))
            .unwrap();
        assert!(
            example.exists(),
            "{} not built: build the examples (cargo test builds them)",
            example.display()
        );
        let url = format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port());
        let output = tokio::process::Command::new(&example)
            .args([&url, "--json"])
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "exit {:?}: {stdout}{stderr}",
            output.status
        );
        assert!(
            stdout.starts_with(r#"{"engine":"postgres","verdict":"#),
            "{stdout}"
        );
        assert!(
            stdout.contains(r#""check":"exclusion","verdict":"pass""#),
            "{stdout}"
        );
    }

    /// PostgreSQL issues fencing tokens only with `fencing(true)`: without, the check
    /// warns and names the setting; with, the tokens it saw go up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_without_fencing_is_told_how_to_turn_it_on() {
        let pg = PgServer::start();
        let unfenced = PostgresBackend::builder_from_str(&pg.conn_str()).unwrap();
        let report = check(unfenced.build().await.unwrap()).await;
        assert_finding(
            &report,
            "fencing_tokens",
            Verdict::Warn,
            "no fencing tokens",
        );
        let fix = report
            .finding("fencing_tokens")
            .unwrap()
            .fix
            .as_deref()
            .unwrap_or("");
        assert!(fix.contains("fencing(true)"), "{report}");
        assert_finding(&report, "lock_scope", Verdict::Pass, "session locks");
        assert_finding(&report, "server_version", Verdict::Pass, "PostgreSQL ");
        assert_finding(&report, "clock_offset", Verdict::Pass, "this machine's");

        let fenced = PostgresBackend::builder_from_str(&pg.conn_str())
            .unwrap()
            .fencing(true);
        let report = check(fenced.build().await.unwrap()).await;
        assert_finding(
            &report,
            "fencing_tokens",
            Verdict::Pass,
            "each above the last",
        );
        assert!(report.is_safe(), "{report}");
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    use tower_keyed_lock::backend::etcd::EtcdBackend;
    use tower_keyed_lock::backend::Verdict;

    use super::{assert_finding, check};
    use crate::etcd::stale_leader_fixed;
    use crate::support::etcd_server::EtcdCluster;

    /// The member's version is named, and one without the stale-leader fix (Debian 12
    /// ships 3.4.23) is a warning that names the releases with it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_names_its_version_against_the_stale_leader_fix() {
        let cluster = EtcdCluster::start();
        let backend = EtcdBackend::connect(cluster.endpoints()).await.unwrap();
        let mut client = etcd_client::Client::connect(cluster.endpoints(), None)
            .await
            .unwrap();
        let version = client.status().await.unwrap().version().to_owned();
        let report = check(backend).await;
        let expected = match stale_leader_fixed(&version) {
            true => Verdict::Pass,
            false => Verdict::Warn,
        };
        assert_finding(&report, "server_version", expected, &version);
        if expected == Verdict::Warn {
            let fix = report
                .finding("server_version")
                .unwrap()
                .fix
                .as_deref()
                .unwrap();
            assert!(
                fix.contains("3.4.31") && fix.contains("refuse_stale_leader_revocation"),
                "{report}"
            );
        }
    }
}

#[cfg(feature = "zookeeper")]
mod zookeeper {
    use std::time::Duration;

    use tower_keyed_lock::backend::zookeeper::ZooKeeperBackend;
    use tower_keyed_lock::backend::Verdict;

    use super::{assert_finding, check};
    use crate::support::zookeeper_server::{ZooKeeperEnsemble, TICK};

    /// A lease past the ensemble's bound (20 ticks) is granted shorter: a warning that
    /// says both; a lease within the bounds passes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_timeout_moved_by_the_ensemble_is_a_warning() {
        let ensemble = ZooKeeperEnsemble::start();
        let build = |lease: Duration| {
            ZooKeeperBackend::builder(ensemble.connect_string())
                .lease(lease)
                .build()
        };
        let report = check(build(TICK * 40).await.unwrap()).await;
        let granted = format!("{:?} granted for the {:?} asked", TICK * 20, TICK * 40);
        assert_finding(&report, "session_timeout", Verdict::Warn, &granted);
        let report = check(build(TICK * 10).await.unwrap()).await;
        assert_finding(&report, "session_timeout", Verdict::Pass, "granted");
    }
}

#[cfg(feature = "dynamodb")]
mod dynamodb {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };
    use tower_keyed_lock::backend::dynamodb::{DynamoDbBackend, DEFAULT_PARTITION_KEY};
    use tower_keyed_lock::backend::Verdict;

    use super::{assert_finding, check};
    use crate::support::moto_server::MotoServer as DynamoServer;

    /// A lock table made without TTL (by hand, not by `create_table`) keeps the items
    /// of crashed holders: a warning with the command that turns it on; the table the
    /// backend makes has it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lock_table_without_ttl_is_a_warning() {
        let dynamo = DynamoServer::start();
        let client = dynamo.client();
        let definition = AttributeDefinition::builder()
            .attribute_name(DEFAULT_PARTITION_KEY)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .unwrap();
        let schema = KeySchemaElement::builder()
            .attribute_name(DEFAULT_PARTITION_KEY)
            .key_type(KeyType::Hash)
            .build()
            .unwrap();
        client
            .create_table()
            .table_name("by-hand")
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(definition)
            .key_schema(schema)
            .send()
            .await
            .unwrap();
        let by_hand = DynamoDbBackend::builder(client.clone(), "by-hand")
            .build()
            .await
            .unwrap();
        let report = check(by_hand).await;
        assert_finding(&report, "time_to_live", Verdict::Warn, "table by-hand");
        let fix = report
            .finding("time_to_live")
            .unwrap()
            .fix
            .as_deref()
            .unwrap();
        assert!(fix.contains("update-time-to-live"), "{report}");

        let made = DynamoDbBackend::builder(client, "made");
        made.create_table().await.unwrap();
        let report = check(made.build().await.unwrap()).await;
        assert_finding(&report, "time_to_live", Verdict::Pass, "ENABLED");
        // moto runs on this machine's clock: within the `Date`s' uncertainty.
        assert_finding(&report, "clock_offset", Verdict::Pass, "this machine's");
    }
}

#[cfg(feature = "azure-blob")]
mod azure_blob {
    use tower_keyed_lock::backend::Verdict;

    use super::{assert_finding, check};
    use crate::support::fixtures::{AzureBlob, Fixture, AZURE_LEASE};

    /// Azure's lease period and clock (read from the `Date` of its answers during the
    /// live run) are reported; Azurite runs on this machine's clock, so the offset is
    /// within its uncertainty.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn azure_reports_its_lease_period_and_clock() {
        let fixture = AzureBlob::start();
        let report = check(fixture.azure_backend().await).await;
        let lease = format!("blob leases of {} s", AZURE_LEASE.as_secs());
        assert_finding(&report, "lease_period", Verdict::Pass, &lease);
        assert_finding(&report, "clock_offset", Verdict::Pass, "this machine's");
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use tower_keyed_lock::backend::mysql::MySqlBackend;
    use tower_keyed_lock::backend::Verdict;

    use super::{assert_finding, check};
    use crate::support::mysql_server::MySqlServer;

    /// The server is named with its version, and its clock (`NOW(6)`) read against
    /// this machine's: the same machine here, so within the round trip.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_names_its_server_and_clock() {
        let server = MySqlServer::start();
        let report = check(MySqlBackend::connect(&server.url()).await.unwrap()).await;
        assert_finding(&report, "server", Verdict::Pass, "MariaDB");
        assert_finding(&report, "clock_offset", Verdict::Pass, "this machine's");
        assert!(report.is_safe(), "{report}");
    }
}

#[cfg(feature = "s3")]
mod s3 {
    use tower_keyed_lock::backend::s3::S3Backend;
    use tower_keyed_lock::backend::Verdict;

    use super::{assert_finding, check};
    use crate::support::moto_server::{Misbehaviour, MotoServer};

    async fn backend(server: &MotoServer) -> S3Backend {
        let client = server.s3_client();
        client.create_bucket().bucket("locks").send().await.unwrap();
        S3Backend::builder(client, "locks").build().await.unwrap()
    }

    /// The store's conditional writes are probed again (a second create refused); its
    /// clock, read from the `Date` of its answers, is within their uncertainty.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn s3_probes_conditional_writes_and_reads_its_clock() {
        let server = MotoServer::start();
        let report = check(backend(&server).await).await;
        assert_finding(
            &report,
            "conditional_writes",
            Verdict::Pass,
            "were both refused",
        );
        assert_finding(&report, "clock_offset", Verdict::Pass, "this machine's");
        assert!(report.is_safe(), "{report}");
    }

    /// A store whose clock is 30 s ahead (its host's time sync broken) is a warning
    /// that says by how much; the locks, timed by each side's own clock, still work.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_clock_far_off_is_a_warning() {
        let server = MotoServer::misbehaving(Misbehaviour::ClockAhead(30));
        let report = check(backend(&server).await).await;
        assert_finding(
            &report,
            "clock_offset",
            Verdict::Warn,
            "ahead of this machine's",
        );
        let saw = &report.finding("clock_offset").unwrap().saw;
        let offset: f64 = saw
            .trim_start_matches("the server's clock is ")
            .split(' ')
            .next()
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_else(|| panic!("no offset in {saw:?}"));
        assert!(
            (29_000.0..32_000.0).contains(&offset),
            "about 30 s: {report}"
        );
        assert_finding(&report, "exclusion", Verdict::Pass, "refused");
        assert!(report.is_safe(), "{report}");
    }
}
