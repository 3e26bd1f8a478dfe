//! A lock server's wall clock, as far as this process can know it from the `Date` of
//! the server's answers: an interval that surely holds the server's time now.
//!
//! Engines that delete a released key's record (DynamoDB, Azure Blob) start the
//! fencing tokens of a new record from the top of the interval and delete a record
//! only once the bottom has passed its last token: the next record's tokens start
//! above every token of the deleted one, whichever instance makes it, with no
//! comparison of the instances' own clocks.
//!
//! It also keeps the highest token this process has seen: a new record starts above
//! that as well, so an engine's records deleted by hand never send this process's own
//! tokens back.
//!
//! An answer dated `D` (whole seconds) to a request sent at `s` and answered at `r`
//! (this process's monotonic clock) was stamped at some moment in between, when the
//! server's clock read at least `D` and less than `D + 1 s`. So the server's clock
//! read less than `D + 1 s` at `s`, and at least `D` at `r`. Each bound is carried
//! forward on this process's clock, allowing for the two clocks' rates to differ by
//! up to [`RATE_SLACK`]; every answer keeps whichever bound is tighter. Answers that
//! arrive at different phases of the server's second narrow the interval to about a
//! round trip.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// How far this process's monotonic clock and the server's wall clock may run apart:
/// one part in this many (1 %, as the drift margin of a lease allows).
pub(crate) const RATE_SLACK: u64 = 100;

/// An interval holding the server's clock, and the highest token seen: see the module
/// docs. The interval is empty until an answer with a `Date` was observed.
#[derive(Debug, Default)]
pub(crate) struct ServerClock {
    bounds: Mutex<Option<Bounds>>,
    highest_token: AtomicU64,
}

#[derive(Clone, Copy, Debug)]
struct Bounds {
    /// The server's clock read at least this at its instant.
    low: Anchor,
    /// The server's clock read at most this at its instant.
    high: Anchor,
}

/// A reading of the server's clock in microseconds since the epoch, pinned to an
/// instant of this process's clock.
#[derive(Clone, Copy, Debug)]
struct Anchor {
    micros: u64,
    at: Instant,
}

impl Anchor {
    /// The least the server's clock can read at `now`, from this lower bound.
    fn low_at(self, now: Instant) -> u64 {
        let since = micros(now.saturating_duration_since(self.at));
        self.micros.saturating_add(since - since / RATE_SLACK)
    }

    /// The most the server's clock can read at `now`, from this upper bound.
    fn high_at(self, now: Instant) -> u64 {
        let since = micros(now.saturating_duration_since(self.at));
        self.micros
            .saturating_add(since)
            .saturating_add(since / RATE_SLACK + 1)
    }
}

fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

impl ServerClock {
    /// Takes in an answer dated `date_secs` (seconds since the epoch) to a request sent
    /// at `sent` and answered at `received`.
    pub(crate) fn observe(&self, date_secs: u64, sent: Instant, received: Instant) {
        let date = date_secs.saturating_mul(1_000_000);
        let seen = Bounds {
            low: Anchor {
                micros: date,
                at: received,
            },
            high: Anchor {
                micros: date.saturating_add(1_000_000),
                at: sent,
            },
        };
        let mut bounds = self.bounds.lock().unwrap_or_else(|e| e.into_inner());
        let kept = match *bounds {
            None => seen,
            Some(old) => {
                let low = match old.low.low_at(received) > date {
                    true => old.low,
                    false => seen.low,
                };
                let high = match old.high.high_at(received) < seen.high.high_at(received) {
                    true => old.high,
                    false => seen.high,
                };
                match low.low_at(received) <= high.high_at(received) {
                    true => Bounds { low, high },
                    // The bounds contradict each other: the server's clock was set
                    // (or another of its hosts disagrees). Start again from this answer.
                    false => seen,
                }
            }
        };
        *bounds = Some(kept);
    }

    /// The least the server's clock can read now, in microseconds since the epoch;
    /// `None` before any dated answer.
    pub(crate) fn at_least(&self, now: Instant) -> Option<u64> {
        self.bounds().map(|bounds| bounds.low.low_at(now))
    }

    /// The most the server's clock can read now, in microseconds since the epoch;
    /// `None` before any dated answer.
    pub(crate) fn at_most(&self, now: Instant) -> Option<u64> {
        self.bounds().map(|bounds| bounds.high.high_at(now))
    }

    /// The most the server's clock can read when a write sent now lands: at the latest
    /// two command timeouts after it is sent (the crate counts a write unanswered that
    /// long as never landing). `None` before any dated answer.
    pub(crate) fn at_most_on_landing(&self, command_timeout: Duration) -> Option<u64> {
        let landing = 2 * command_timeout;
        let landing = landing + landing / RATE_SLACK as u32;
        self.at_most(Instant::now() + landing)
    }

    /// Where the tokens of a new record written now start (its first is one above): the
    /// most the server's clock can read when the write lands
    /// ([`at_most_on_landing`](Self::at_most_on_landing)), or this machine's clock
    /// before any dated answer; and never below a token [seen](Self::saw_token).
    pub(crate) fn token_start(&self, command_timeout: Duration) -> u64 {
        let clock = self.at_most_on_landing(command_timeout).unwrap_or_else(|| {
            let since = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            micros(since)
        });
        clock.max(self.highest_token.load(Ordering::Relaxed))
    }

    /// Records a token this process read or was granted, for [`token_start`](Self::token_start).
    pub(crate) fn saw_token(&self, token: u64) {
        self.highest_token.fetch_max(token, Ordering::Relaxed);
    }

    /// Whether the server's clock is surely past `micros` now.
    pub(crate) fn is_past(&self, micros: u64) -> bool {
        self.at_least(Instant::now())
            .is_some_and(|now| now > micros)
    }

    /// When, at the soonest, the server's clock is surely past `micros` (its lower bound
    /// above it); `None` before any dated answer.
    pub(crate) fn surely_past(&self, micros: u64) -> Option<Instant> {
        let low = self.bounds()?.low;
        let ahead = micros.saturating_add(1).saturating_sub(low.micros);
        // The lower bound gains (1 - 1/RATE_SLACK) µs per µs of this clock.
        let wait = ahead.saturating_add(ahead / (RATE_SLACK - 1) + 1);
        Some(low.at + Duration::from_micros(wait))
    }

    fn bounds(&self) -> Option<Bounds> {
        *self.bounds.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A server whose clock starts at `start` µs and runs at `rate_ppm` parts per
    /// million off this process's clock (within the slack).
    struct Server {
        origin: Instant,
        start: u64,
        rate_ppm: i64,
    }

    impl Server {
        fn reads_at(&self, at: Instant) -> u64 {
            let since = (at - self.origin).as_micros() as i64;
            (self.start as i64 + since + since * self.rate_ppm / 1_000_000) as u64
        }
    }

    proptest! {
        /// Whatever the answers' delays and the two clocks' rates (within the slack),
        /// the server's clock stays inside the interval, and `surely_past` is never
        /// early.
        #[test]
        fn the_interval_holds_the_server_clock(
            start in 1_700_000_000_000_000u64..1_800_000_000_000_000,
            rate_ppm in -9_000i64..9_000,
            answers in proptest::collection::vec((0u64..3_000_000, 0u64..50_000, 0u64..=100), 1..40),
            probe in 0u64..5_000_000,
        ) {
            let origin = Instant::now();
            let server = Server { origin, start, rate_ppm };
            let clock = ServerClock::default();
            let mut at = origin;
            for (gap, round_trip, stamp_percent) in answers {
                let sent = at + Duration::from_micros(gap);
                let stamped = sent + Duration::from_micros(round_trip * stamp_percent / 100);
                let received = sent + Duration::from_micros(round_trip);
                clock.observe(server.reads_at(stamped) / 1_000_000, sent, received);
                at = received;
                let low = clock.at_least(at).unwrap();
                let high = clock.at_most(at).unwrap();
                let truth = server.reads_at(at);
                prop_assert!(low <= truth && truth <= high, "{low} <= {truth} <= {high}");
            }
            let now = at + Duration::from_micros(probe);
            let truth = server.reads_at(now);
            prop_assert!(clock.at_least(now).unwrap() <= truth);
            prop_assert!(truth <= clock.at_most(now).unwrap());
            let target = truth.saturating_sub(probe / 2);
            let past = clock.surely_past(target).unwrap();
            prop_assert!(server.reads_at(past) > target);
        }
    }

    #[test]
    fn answers_at_different_phases_narrow_the_interval() {
        let origin = Instant::now();
        let server = Server {
            origin,
            start: 1_800_000_000_400_000,
            rate_ppm: 0,
        };
        let clock = ServerClock::default();
        assert_eq!(clock.at_least(origin), None);
        let round_trip = Duration::from_millis(2);
        for n in 0..20u64 {
            let sent = origin + Duration::from_millis(97 * n);
            let stamped = sent + round_trip / 2;
            clock.observe(
                server.reads_at(stamped) / 1_000_000,
                sent,
                sent + round_trip,
            );
        }
        let now = origin + Duration::from_millis(97 * 20);
        let width = clock.at_most(now).unwrap() - clock.at_least(now).unwrap();
        assert!(
            width < 150_000,
            "twenty answers 97 ms apart leave {width} µs of doubt"
        );
    }
}
