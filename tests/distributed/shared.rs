//! `DistributedLocks::lock_shared`: shared holders in process; refused, never
//! downgraded, on a backend (none holds a key shared across instances yet).

use tower_keyed_lock::LockError;

use crate::support::fixtures::Fixture;

for_each_fixture!(
    all: [shared_locks_in_process_and_refused_by_a_backend],
    remote: [],
);

async fn shared_locks_in_process_and_refused_by_a_backend<F: Fixture>() {
    let fixture = F::start();
    let locks = fixture.instance("a").await;
    if locks.is_distributed() {
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
    let reader = locks.lock_shared("order-7").await.unwrap();
    let another = locks.try_lock_shared("order-7").await.unwrap();
    assert!(reader.is_shared() && another.is_shared());
    assert!(matches!(
        locks.try_lock("order-7").await,
        Err(LockError::Busy)
    ));
    drop((reader, another));
    let writer = locks.try_lock("order-7").await.unwrap();
    assert!(!writer.is_shared());
    assert!(matches!(
        locks.try_lock_shared("order-7").await,
        Err(LockError::Busy)
    ));
}
