//! `DistributedLocks::lock_shared`: shared holders in process and, on a backend that
//! holds keys shared (Redis, PostgreSQL), across instances; refused, never downgraded,
//! on the others.

use tower_keyed_lock::backend::LockMode;
use tower_keyed_lock::LockError;

use crate::support::fixtures::Fixture;

for_each_fixture!(
    all: [shared_locks_across_instances_or_refused],
    remote: [],
);

async fn shared_locks_across_instances_or_refused<F: Fixture>() {
    let fixture = F::start();
    let locks = fixture.instance("a").await;
    if !locks.supports(LockMode::Shared) {
        assert!(
            locks.is_distributed(),
            "in process, keys can always be shared"
        );
        for result in [
            locks.lock_shared("order-7").await,
            locks.try_lock_shared("order-7").await,
        ] {
            match result {
                Err(error @ LockError::Unsupported(_)) => {
                    assert!(error.to_string().contains("shared locks"), "{error}")
                }
                other => panic!("expected Unsupported, got {other:?}"),
            }
        }
        assert!(
            locks.is_empty(),
            "a refused shared lock left something held"
        );
        return;
    }
    // A second instance (in process: the same table, as one instance has one).
    let other = match locks.is_distributed() {
        true => fixture.instance("b").await,
        false => locks.clone(),
    };
    let reader = locks.lock_shared("order-7").await.unwrap();
    let another = other.try_lock_shared("order-7").await.unwrap();
    assert!(reader.is_shared() && another.is_shared());
    assert!(matches!(
        other.try_lock("order-7").await,
        Err(LockError::Busy)
    ));
    reader.release().await;
    another.release().await;
    let writer = other.try_lock("order-7").await.unwrap();
    assert!(!writer.is_shared());
    assert!(matches!(
        locks.try_lock_shared("order-7").await,
        Err(LockError::Busy)
    ));
    writer.release().await;
}

/// An engine that holds keys exclusively only, as a user might write one.
struct ExclusiveOnly;

impl tower_keyed_lock::LockBackend for ExclusiveOnly {
    fn acquire(
        &self,
        _: &str,
        _: &tower_keyed_lock::Key,
        _: std::time::Duration,
    ) -> tower_keyed_lock::backend::Acquisition {
        Box::pin(async { Err(LockError::Backend("unreachable".into())) })
    }

    fn engine(&self) -> &'static str {
        "exclusive-only"
    }
}

#[test]
#[should_panic(
    expected = "DistributedLocks::permits(3): the exclusive-only lock backend does not support 3 permits per key across instances"
)]
fn permits_an_engine_cannot_count_are_refused_when_built() {
    let _ = tower_keyed_lock::DistributedLocks::builder("exports")
        .backend(ExclusiveOnly)
        .permits(3)
        .build();
}

#[test]
fn one_permit_is_the_exclusive_lock_on_any_engine() {
    let locks = tower_keyed_lock::DistributedLocks::builder("exports")
        .backend(ExclusiveOnly)
        .permits(1)
        .build();
    assert!(locks.supports(LockMode::Exclusive));
    assert!(!locks.supports(LockMode::Shared));
    assert!(!locks.supports(LockMode::Permit { of: 3 }));
}

#[tokio::test]
async fn shared_locks_on_an_engine_without_them_are_refused_naming_it() {
    let locks = tower_keyed_lock::DistributedLocks::new("orders", ExclusiveOnly);
    match locks.lock_shared("order-7").await {
        Err(error @ LockError::Unsupported(_)) => {
            assert!(
                error.to_string().contains("shared locks across instances"),
                "{error}"
            )
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
    assert!(
        locks.is_empty(),
        "a refused shared lock left something held"
    );
}
