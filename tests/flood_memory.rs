//! Resident memory under a key flood: with `max_keys`, a client inventing a new key per
//! request cannot grow the table past the bound. Its own test binary, so no other test
//! allocates while resident memory is measured.

use tower_keyed_lock::{KeyedLocks, LockError};

/// Resident set size of this process, in bytes (Linux).
fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn max_keys_bounds_memory_under_a_key_flood() {
    const MAX_KEYS: usize = 10_000;
    const FLOOD: usize = 1_000_000;
    let locks = KeyedLocks::<String>::builder().max_keys(MAX_KEYS).build();
    let before = resident_bytes();

    // Every invented key is held (the worst case: none is ever released).
    let mut held = Vec::with_capacity(MAX_KEYS);
    let mut refused = 0;
    for n in 0..FLOOD {
        match locks.try_lock(format!("attacker-key-{n:012}")) {
            Ok(guard) => held.push(guard),
            Err(LockError::TooManyKeys) => refused += 1,
            Err(other) => panic!("{other}"),
        }
    }
    let grown = resident_bytes().saturating_sub(before);

    assert_eq!(held.len(), MAX_KEYS);
    assert_eq!(refused, FLOOD - MAX_KEYS);
    assert_eq!(locks.len(), MAX_KEYS);
    // 10 000 keys of ~25 bytes: a few MB at most, where the 1M keys unbounded would
    // take well over 100 MB.
    println!(
        "flood of {FLOOD} keys, max_keys {MAX_KEYS}: resident memory grew {} KiB",
        grown / 1024
    );
    assert!(grown < 16 << 20, "resident memory grew {grown} bytes");

    // A legitimate key still gets in once the flood's keys are gone.
    drop(held);
    assert!(locks.is_empty());
    assert!(locks.try_lock("order-42".to_owned()).is_ok());
}
