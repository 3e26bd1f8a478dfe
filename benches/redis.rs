//! Placeholder: the redis benchmarks are being written.
fn main() {}
