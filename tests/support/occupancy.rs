//! Who is inside each key's handler, to tell an overlap that a lost lease explains from
//! one that nothing explains. The guarantee is no *unsignalled* overlap: a holder whose
//! lease was lost (a server restarted, a session killed) is told so, and another
//! instance may then be granted the key while the first still runs. A server that ends
//! the holding session itself (a restarted PostgreSQL frees every lock at once) may
//! grant the key before the holder's connection watch has run: the holder must then be
//! told before its handler ends (its next look), and the grant's token is higher.
#![allow(dead_code)]

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use tower_keyed_lock::LeaseSignal;

/// A holder inside a key.
struct Holder {
    ticket: u64,
    /// None in process.
    lease: Option<LeaseSignal>,
    /// Another holder entered while this one had not been told: it must be told by
    /// the time it leaves.
    overlapped_untold: bool,
}

impl Holder {
    fn told(&self) -> bool {
        self.lease.as_ref().is_some_and(LeaseSignal::is_lost)
    }
}

pub struct Occupancy<K> {
    inside: Mutex<HashMap<K, Vec<Holder>>>,
    next: AtomicU64,
    /// Holders that another holder's entry overlapped and that left without being
    /// told their lease was lost.
    unsignalled: AtomicU64,
    /// Holders overlapped before being told, told by the time they left (allowed).
    told_late: AtomicU64,
    /// Entries while every holder inside had been told (allowed).
    signalled: AtomicU64,
}

impl<K: Eq + Hash + Clone> Default for Occupancy<K> {
    fn default() -> Self {
        Self {
            inside: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            unsignalled: AtomicU64::new(0),
            told_late: AtomicU64::new(0),
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
        let mut untold = false;
        for holder in holders.iter_mut().filter(|holder| !holder.told()) {
            holder.overlapped_untold = true;
            untold = true;
        }
        if !untold && !holders.is_empty() {
            self.signalled.fetch_add(1, Relaxed);
        }
        holders.push(Holder {
            ticket,
            lease: lease.cloned(),
            overlapped_untold: false,
        });
        Occupant {
            occupancy: self,
            key,
            ticket,
        }
    }

    /// Holders overlapped by another's entry before being told, and still not told
    /// when they left.
    pub fn unsignalled_overlaps(&self) -> u64 {
        self.unsignalled.load(Relaxed)
    }

    /// Holders overlapped before being told, and told before they left.
    pub fn told_late_overlaps(&self) -> u64 {
        self.told_late.load(Relaxed)
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
            if let Some(leaving) = holders.iter().find(|h| h.ticket == self.ticket) {
                if leaving.overlapped_untold {
                    let count = match leaving.told() {
                        true => &self.occupancy.told_late,
                        false => &self.occupancy.unsignalled,
                    };
                    count.fetch_add(1, Relaxed);
                }
            }
            holders.retain(|holder| holder.ticket != self.ticket);
            if holders.is_empty() {
                inside.remove(&self.key);
            }
        }
    }
}
