//! The spans of `DistributedLocks`, captured by a real subscriber: `keyed_lock.wait`
//! with its outcome, `keyed_lock.remote` with the engine and the fencing token, and
//! `run_while_held`'s `keyed_lock.hold`, with the event that cancels the work.

use tower_keyed_lock::DistributedLocks;

use crate::metrics::LosesEveryLease;
use crate::support::logs::Captured;

#[tokio::test]
async fn an_acquisition_and_a_lost_hold_are_traced() {
    let captured = Captured::default();
    let _subscriber = captured.install_with_spans();
    let locks = DistributedLocks::new("traced-jobs", LosesEveryLease);
    let guard = locks.lock("nightly-report").await.unwrap();
    let ran = guard
        .run_while_held(async { tracing::info!("working") })
        .await;
    assert!(ran.is_err(), "the lease was lost before the work could run");
    drop(guard);
    let text = captured.text();
    let line = |span: &str| {
        text.lines()
            .find(|line| line.contains(span))
            .unwrap_or_else(|| panic!("no {span}:\n{text}"))
            .to_owned()
    };
    let remote = line("keyed_lock.remote{");
    for field in [
        r#"name="traced-jobs""#,
        r#"engine="custom""#,
        r#"outcome="acquired""#,
        "fencing_token=1",
    ] {
        assert!(remote.contains(field), "{field} missing: {remote}");
    }
    assert!(
        line("keyed_lock.wait{").contains(r#"outcome="acquired""#),
        "{text}"
    );
    assert!(
        line("the lease was lost").contains("keyed_lock.hold{"),
        "{text}"
    );
    assert!(
        !text.contains("nightly-report"),
        "a span carried the key:\n{text}"
    );
}
