//! The table gives memory back after a burst (issue 11.7): 500 000 keys held at once
//! and then released used to leave ~100 MB resident with `len() == 0`, because the
//! table kept its peak capacity. Its own test binary, so no other test allocates while
//! resident memory is measured.

use tower_keyed_lock::KeyedLocks;

/// Resident set size of this process, in bytes (Linux).
fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

const BURST: u64 = 500_000;

#[test]
fn resident_memory_returns_after_a_burst_of_keys() {
    let locks = KeyedLocks::<u64>::new();
    let before = resident_bytes();

    let held: Vec<_> = (0..BURST).map(|key| locks.try_lock(key).unwrap()).collect();
    let peak = resident_bytes();
    drop(held);
    assert!(locks.is_empty());
    let after = resident_bytes();

    let grown = peak.saturating_sub(before);
    let kept = after.saturating_sub(before);
    println!(
        "{BURST} keys held: +{} KiB resident; after release: +{} KiB",
        grown / 1024,
        kept / 1024
    );
    assert!(
        grown > 16 << 20,
        "the burst did not register ({grown} bytes)"
    );
    // The table frees all of it; how much the allocator hands back to the kernel varies
    // from run to run (glibc keeps 0.1–15 MB of the 66 MB in its arena, depending on
    // what is allocated last; with `MALLOC_MMAP_THRESHOLD_=131072` it keeps ~0.1 MB).
    // Before the table shrank, 50 of 58 MB stayed.
    assert!(
        kept < grown / 3,
        "{kept} of {grown} bytes stayed resident after every key was released"
    );

    // The table still works, and grows again, after giving its memory back.
    let again: Vec<_> = (0..1000).map(|key| locks.try_lock(key).unwrap()).collect();
    assert_eq!(locks.len(), 1000);
    drop(again);
    assert!(locks.is_empty());
}
