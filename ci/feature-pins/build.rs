//! Empty: it makes the build-dependencies count, so that procedural macros and build
//! scripts get the pinned features too (see `scripts/feature-pins`).
fn main() {}
