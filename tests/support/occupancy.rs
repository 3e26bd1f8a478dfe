//! Who is inside each key's handler, to tell an overlap that a lost lease explains from
//! one that nothing explains. The guarantee is no *unsignalled* overlap: a holder whose
//! lease was lost (a server restarted, a session killed) is told so, and another
//! instance may then be granted the key while the first still runs.
#![allow(dead_code)]

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use tower_keyed_lock::LeaseSignal;

/// A holder inside a key: its ticket, and its lease signal (none in process).
type Holder = (u64, Option<LeaseSignal>);

pub struct Occupancy<K> {
    inside: Mutex<HashMap<K, Vec<Holder>>>,
    next: AtomicU64,
    /// Entries while a holder inside had not been told its lease was lost.
    unsignalled: AtomicU64,
    /// Entries while every holder inside had been told (allowed).
    signalled: AtomicU64,
}

impl<K: Eq + Hash + Clone> Default for Occupancy<K> {
    fn default() -> Self {
        Self {
            inside: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            unsignalled: AtomicU64::new(0),
            signalled: AtomicU64::new(0),
        }
    }
}

impl<K: Eq + Hash + Clone> Occupancy<K> {
    /// Enters `key` with the holder's `lease`, counting an overlap by whether the
    /// holders inside were told; the holder leaves when the returned value drops (a
    /// disconnecting client drops its handler at an await).
    pub fn enter(&self, key: K, lease: Option<&LeaseSignal>) -> Occupant<'_, K> {
        let ticket = self.next.fetch_add(1, Relaxed);
        let mut inside = self.inside.lock().unwrap();
        let holders = inside.entry(key.clone()).or_default();
        if holders
            .iter()
            .any(|(_, other)| !other.as_ref().is_some_and(LeaseSignal::is_lost))
        {
            self.unsignalled.fetch_add(1, Relaxed);
        } else if !holders.is_empty() {
            self.signalled.fetch_add(1, Relaxed);
        }
        holders.push((ticket, lease.cloned()));
        Occupant {
            occupancy: self,
            key,
            ticket,
        }
    }

    /// Second holders that entered while a holder inside had not been told.
    pub fn unsignalled_overlaps(&self) -> u64 {
        self.unsignalled.load(Relaxed)
    }

    /// Second holders that entered after every holder inside had been told.
    pub fn signalled_overlaps(&self) -> u64 {
        self.signalled.load(Relaxed)
    }
}

/// A holder inside a key, until dropped.
pub struct Occupant<'a, K: Eq + Hash> {
    occupancy: &'a Occupancy<K>,
    key: K,
    ticket: u64,
}

impl<K: Eq + Hash> Drop for Occupant<'_, K> {
    fn drop(&mut self) {
        let mut inside = self.occupancy.inside.lock().unwrap();
        if let Some(holders) = inside.get_mut(&self.key) {
            holders.retain(|(ticket, _)| *ticket != self.ticket);
            if holders.is_empty() {
                inside.remove(&self.key);
            }
        }
    }
}
