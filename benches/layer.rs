//! Placeholder: the layer benchmarks are being written.
fn main() {}
