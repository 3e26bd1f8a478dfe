//! The check of several keys at once across instances (`lock_all`).

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use super::inside::Inside;
use super::{instance, while_turns_are_taken, within, Deployment, TURN_WAIT};
use crate::LockError;

/// Three instances take overlapping pairs of keys, each naming them in its own order
/// (`[a, b]`, `[c, b]`, `[a, c]`, …): no key has two holders (unless the first had
/// been told its lease was lost), and every turn is taken
/// (a deadlock between the pairs would stall them). Then, while one instance holds
/// `b`, another's `try_lock_all(["a", "b"])` is `Busy` and leaves `a` free.
pub async fn several_keys_all_or_nothing<D: Deployment>(deployment: &D) {
    const TURNS: usize = 4;
    const PAIRS: [[&str; 2]; 6] = [
        ["a", "b"],
        ["b", "a"],
        ["c", "b"],
        ["b", "c"],
        ["a", "c"],
        ["c", "a"],
    ];
    let inside = Arc::new(Inside::new(3));
    let turns = Arc::new(AtomicUsize::new(0));
    let index = |key: &str| usize::from(key.as_bytes()[0] - b'a');
    let mut tasks = Vec::new();
    for instance_no in 0..3 {
        let locks = instance(deployment, "conformance-several").await;
        for pair in PAIRS.iter().skip(instance_no % 2).step_by(2) {
            let (locks, inside, turns) = (locks.clone(), inside.clone(), turns.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..TURNS {
                    let both = locks.lock_all_timeout(*pair, TURN_WAIT).await.unwrap();
                    let tickets: Vec<_> = both
                        .guards()
                        .iter()
                        .map(|guard| {
                            let key = guard.key();
                            let what = format!("key {key} held twice by lock_all");
                            (index(key), inside.enter(index(key), guard.lease(), &what))
                        })
                        .collect();
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    for (key, ticket) in tickets {
                        inside.leave(key, ticket);
                    }
                    both.release().await;
                    turns.fetch_add(1, SeqCst);
                }
            }));
        }
    }
    while_turns_are_taken("lock_all", &turns, tasks).await;

    let a = instance(deployment, "conformance-several").await;
    let b = instance(deployment, "conformance-several").await;
    let held = a.lock("b").await.unwrap();
    assert!(
        matches!(b.try_lock_all(["a", "b"]).await, Err(LockError::Busy)),
        "conformance: try_lock_all was not Busy while another instance held one key"
    );
    let free = within("the key try_lock_all gave back", async {
        loop {
            match a.try_lock("a").await {
                Ok(guard) => return guard,
                Err(LockError::Busy) => tokio::time::sleep(Duration::from_millis(10)).await,
                Err(error) => panic!("conformance: {error}"),
            }
        }
    })
    .await;
    free.release().await;
    held.release().await;
}
