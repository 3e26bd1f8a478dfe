//! `DistributedLocks::lock_all` dropped while it waits at each of its keys in turn: the
//! keys it had taken are given back, in this process and at the backend.

use std::time::Duration;

use crate::support::fixtures::{eventually, wait_free, Fixture, PATIENCE};

for_each_fixture!(
    all: [lock_all_dropped_at_each_key_gives_back_what_it_took],
    remote: [],
);

async fn lock_all_dropped_at_each_key_gives_back_what_it_took<F: Fixture>() {
    const KEYS: [&str; 3] = ["k1", "k2", "k3"];
    let fixture = F::start();
    let (a, b) = (fixture.instance("a").await, fixture.instance("b").await);
    for blocker in KEYS {
        let held = b.lock(blocker).await.unwrap();
        let mut all = Box::pin(a.lock_all(["k3", "k1", "k2"]));
        // Long enough to take the keys before the blocker and wait at it.
        let waited = tokio::time::timeout(Duration::from_millis(300), &mut all).await;
        assert!(
            waited.is_err(),
            "lock_all got {blocker} while another instance held it"
        );
        drop(all);
        held.release().await;
        for key in KEYS {
            wait_free(&b, key, PATIENCE).await;
        }
        // The local tier is given back right after the remote one.
        eventually("the local keys are given back", || a.is_empty()).await;
    }
    // With a wait: a try's single command timeout can pass on a loaded machine.
    let all = a.lock_all(KEYS).await.unwrap();
    assert_eq!(all.keys().collect::<Vec<_>>(), KEYS);
    all.release().await;
}
