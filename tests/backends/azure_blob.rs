//! placeholder
#![cfg(feature = "azure-blob")]
