//! The in-process table (`KeyedLocks`): several keys at once (`all`), cancellation at every await (`cancel`), a
//! proptest against a FIFO model (`model`), a multi-thread stress test (`stress`), and
//! withdrawal cost wherever a waiter sits in the queue (`withdraw`). Its memory after a
//! burst is `tests/locks_memory.rs`, a process of its own; its interleavings are
//! `tests/loom.rs`.

mod all;
mod cancel;
mod model;
mod stress;
mod withdraw;
