//! Pauses between attempts: jittered, so instances woken by one event do not retry in
//! lockstep, and growing, so a failing engine is not hammered.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Exponential backoff from `first` to `max`, each pause jittered.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self {
            next: first.min(max),
            max,
        }
    }

    /// The next pause: between half of the current step and all of it; the step
    /// doubles up to `max`.
    pub(crate) fn pause(&mut self) -> Duration {
        let pause = jitter(self.next);
        self.next = (self.next * 2).min(self.max);
        pause
    }
}

/// A random duration between half of `max` and `max`.
pub(crate) fn jitter(max: Duration) -> Duration {
    let half = max / 2;
    let spread = u64::try_from((max - half).as_micros()).unwrap_or(u64::MAX);
    half + Duration::from_micros(random() % spread.saturating_add(1))
}

/// A number no other caller, of this process or another, is likely to draw: the std
/// hasher's random keys (fresh per call) over a counter. For spreading pauses and
/// marking statements, not for secrets.
pub(crate) fn random() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_max_with_jitter() {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(60));
        let steps = [10, 20, 40, 60, 60];
        for step in steps.map(Duration::from_millis) {
            let pause = backoff.pause();
            assert!(pause >= step / 2 && pause <= step, "{pause:?} for {step:?}");
        }
    }

    #[test]
    fn jitter_stays_between_half_and_all() {
        for _ in 0..100 {
            let d = jitter(Duration::from_millis(100));
            assert!(d >= Duration::from_millis(50) && d <= Duration::from_millis(100));
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }
}
