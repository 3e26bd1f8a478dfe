//! Placeholder: the locks benchmarks are being written.
fn main() {}
