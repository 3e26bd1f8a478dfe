//! Nothing: this crate exists for its dependencies' features (see `scripts/feature-pins`).
