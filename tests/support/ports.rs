//! Ports for the servers the tests start as processes of their own.
//!
//! Such a server binds its port after the test has chosen it. A port chosen by binding
//! port 0 and closing again lies in the kernel's ephemeral range, where an outgoing
//! connection (the suite opens thousands) or another test's choice can take it first:
//! the server then fails to start, or a test reaches another test's server (CI saw an
//! etcd "cluster" whose third member belonged to another test). Ports here come from
//! below that range, each handed out once per process, and only if nothing listens on
//! it now.
#![allow(dead_code)]

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// Below Linux's default ephemeral range (32768–60999), above the well-known and most
/// registered service ports.
const FIRST: u32 = 20_000;
const COUNT: u32 = 12_000;

/// Handed out so far by this process.
static HANDED_OUT: AtomicU32 = AtomicU32::new(0);

/// A port of 127.0.0.1 that no one listens on now and that this process has not
/// handed out before. Test processes running side by side start at different places.
pub fn free_port() -> u16 {
    let start = std::process::id().wrapping_mul(7_919) % COUNT;
    for _ in 0..COUNT {
        let next = HANDED_OUT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (start + next) % COUNT;
        let port = u16::try_from(port).expect("the range is below 65536");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 127.0.0.1:{FIRST}..{}", FIRST + COUNT);
}
