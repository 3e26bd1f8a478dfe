//! Placeholder: the postgres benchmarks are being written.
fn main() {}
