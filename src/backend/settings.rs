//! One settings core for every lease engine: each concept has one name (`instance_id`,
//! `lease`, `renewal`, `drift_margin`, `command_timeout`, `poll_interval`, `prefix`), its
//! setter and its doc written once ([`lease_settings!`]), one default per engine
//! ([`Defaults`], made from the engine's constants by [`defaults!`]), and one check
//! when the backend is built ([`Settings::check`]), which refuses with the
//! [`SetupError`] every engine's `build` returns.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use super::{default_instance_id, ttl, SetupError};

/// One engine's defaults, and the limits its settings are checked against.
pub(crate) struct Defaults {
    /// How errors name the engine ("Redis", "etcd").
    pub(crate) engine: &'static str,
    pub(crate) lease: Duration,
    /// The leases the engine can keep.
    pub(crate) leases: RangeInclusive<Duration>,
    pub(crate) command_timeout: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) prefix: &'static str,
    /// The engine's rule for a prefix: the prefix as the engine uses it (its separator
    /// appended), or why it cannot.
    pub(crate) prefix_rule: fn(&str) -> Result<String, String>,
}

/// The settings every lease engine shares, as its builder collects them.
#[derive(Clone)]
pub(crate) struct Settings {
    defaults: &'static Defaults,
    /// Written with every grant, for [`LockBackend::holder`](crate::LockBackend::holder).
    pub(crate) instance_id: Arc<str>,
    pub(crate) lease: Duration,
    pub(crate) renewal: bool,
    /// `None`: 1% of the lease + 2 ms.
    pub(crate) drift: Option<Duration>,
    pub(crate) command_timeout: Duration,
    pub(crate) poll_interval: Duration,
    /// As set until [`check`](Self::check)ed, then as the engine uses it.
    pub(crate) prefix: String,
}

impl Settings {
    /// An engine's defaults.
    pub(crate) fn new(defaults: &'static Defaults) -> Self {
        Settings {
            defaults,
            instance_id: default_instance_id().into(),
            lease: defaults.lease,
            renewal: true,
            drift: None,
            command_timeout: defaults.command_timeout,
            poll_interval: defaults.poll_interval,
            prefix: defaults.prefix.to_owned(),
        }
    }

    /// The drift margin: as set, or 1% of the lease + 2 ms.
    pub(crate) fn drift(&self) -> Duration {
        self.drift.unwrap_or_else(|| ttl::default_drift(self.lease))
    }

    /// The timing of the engine's leases.
    pub(crate) fn timing(&self) -> ttl::Timing {
        ttl::Timing::new(self.lease, self.drift(), self.command_timeout).renewal(self.renewal)
    }

    /// Checks every setting against the engine's limits, and settles the prefix as the
    /// engine uses it. A builder's `build` calls it before anything else.
    pub(crate) fn check(mut self) -> Result<Self, SetupError> {
        let Defaults { engine, leases, .. } = self.defaults;
        if !leases.contains(&self.lease) {
            let (min, max) = (leases.start(), leases.end());
            return Err(SetupError::Invalid(if *max == Duration::MAX {
                format!(
                    "the lease {:?} is shorter than {engine}'s {min:?}",
                    self.lease
                )
            } else {
                format!(
                    "the lease {:?} is outside {engine}'s {min:?} to {max:?}",
                    self.lease
                )
            }));
        }
        let drift = self.drift();
        if drift >= self.lease / 2 {
            return Err(SetupError::Invalid(format!(
                "the drift margin {drift:?} is half the lease {:?} or more",
                self.lease
            )));
        }
        for (what, value) in [
            ("command timeout", self.command_timeout),
            ("poll interval", self.poll_interval),
        ] {
            if value.is_zero() {
                return Err(SetupError::Invalid(format!("the {what} is zero")));
            }
        }
        self.prefix = (self.defaults.prefix_rule)(&self.prefix)
            .map_err(|why| SetupError::Invalid(format!("the prefix {:?} {why}", self.prefix)))?;
        self.drift = Some(drift);
        Ok(self)
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("instance_id", &self.instance_id)
            .field("lease", &self.lease)
            .field("renewal", &self.renewal)
            .field("drift", &self.drift)
            .field("command_timeout", &self.command_timeout)
            .field("poll_interval", &self.poll_interval)
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// An engine's [`Defaults`], from the constants its module has for
/// [`lease_settings!`] (`DEFAULT_LEASE`, `MIN_LEASE`, `DEFAULT_COMMAND_TIMEOUT`,
/// `DEFAULT_POLL_INTERVAL`, `DEFAULT_PREFIX`): `defaults!(engine, prefix_rule)` for
/// leases of `MIN_LEASE` or more, `defaults!(engine, prefix_rule, max_lease = MAX)`
/// for an engine that keeps none longer than `MAX`.
macro_rules! defaults {
    ($engine:expr, $prefix_rule:expr) => {
        $crate::backend::settings::defaults!(
            $engine,
            $prefix_rule,
            max_lease = std::time::Duration::MAX
        )
    };
    ($engine:expr, $prefix_rule:expr, max_lease = $max_lease:expr) => {
        $crate::backend::settings::Defaults {
            engine: $engine,
            lease: DEFAULT_LEASE,
            leases: MIN_LEASE..=$max_lease,
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            prefix: DEFAULT_PREFIX,
            prefix_rule: $prefix_rule,
        }
    };
}

pub(crate) use defaults;

/// `prefix` with `separator` appended, unless it is empty or ends with it.
#[cfg(any(feature = "redis", feature = "dynamodb"))]
pub(crate) fn ending_with(prefix: &str, separator: char) -> String {
    let mut prefix = prefix.to_owned();
    if !prefix.is_empty() && !prefix.ends_with(separator) {
        prefix.push(separator);
    }
    prefix
}

/// The setters every lease engine's builder shares, with their docs, written once.
/// Expanded inside the builder's `impl`, for a builder whose settings are at
/// `self.<path>` and whose module has `DEFAULT_LEASE`, `MIN_LEASE`,
/// `DEFAULT_COMMAND_TIMEOUT`, `DEFAULT_POLL_INTERVAL` and `DEFAULT_PREFIX`; the names
/// after the `;` are the setters it gets.
macro_rules! lease_settings {
    ($($path:ident).+;) => {};
    ($($path:ident).+; instance_id $($rest:ident)*) => {
        /// Who this instance is (default
        /// [`default_instance_id`](crate::backend::default_instance_id),
        /// `<hostname>:<pid>`): written with every grant, in the same step, and read
        /// back by [`holder`](crate::LockBackend::holder).
        pub fn instance_id(mut self, instance_id: impl Into<String>) -> Self {
            self.$($path).+.instance_id = instance_id.into().into();
            self
        }
        $crate::backend::settings::lease_settings!($($path).+; $($rest)*);
    };
    ($($path:ident).+; lease $($rest:ident)*) => {
        /// How long a grant lasts on the server without renewal (default
        /// [`DEFAULT_LEASE`], at least [`MIN_LEASE`]; [`build`](Self::build) refuses a
        /// lease out of the engine's range). It bounds how long a crashed instance
        /// keeps a key; a live holder keeps it as long as it runs.
        pub fn lease(mut self, lease: std::time::Duration) -> Self {
            self.$($path).+.lease = lease;
            self
        }
        $crate::backend::settings::lease_settings!($($path).+; $($rest)*);
    };
    ($($path:ident).+; renewal $($rest:ident)*) => {
        /// Whether a held lease is renewed every lease/3 (default on). Off, a hold that
        /// outlasts the lease loses it.
        pub fn renewal(mut self, renewal: bool) -> Self {
            self.$($path).+.renewal = renewal;
            self
        }
        $crate::backend::settings::lease_settings!($($path).+; $($rest)*);
    };
    ($($path:ident).+; drift_margin $($rest:ident)*) => {
        /// What is taken off every validity period for the clock rates of this process
        /// and the server (default 1% of the lease + 2 ms): a lease counts as valid
        /// until the time its request was sent + lease − drift margin. Half the lease or
        /// more is refused by [`build`](Self::build).
        pub fn drift_margin(mut self, margin: std::time::Duration) -> Self {
            self.$($path).+.drift = Some(margin);
            self
        }
        $crate::backend::settings::lease_settings!($($path).+; $($rest)*);
    };
    ($($path:ident).+; command_timeout $($rest:ident)*) => {
        /// The longest one request to the server may take (default
        /// [`DEFAULT_COMMAND_TIMEOUT`]); also the connect timeout. Past it an
        /// acquisition tries again while its wait lasts (a zero wait tries once, for
        /// one command timeout, then fails with
        /// [`LockError::Backend`](crate::LockError::Backend)), a renewal counts as
        /// unanswered, and a release goes on in the background.
        pub fn command_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.$($path).+.command_timeout = timeout;
            self
        }
        $crate::backend::settings::lease_settings!($($path).+; $($rest)*);
    };
    ($($path:ident).+; poll_interval $($rest:ident)*) => {
        /// The longest pause of a waiter between two attempts when it sees no change
        /// (default [`DEFAULT_POLL_INTERVAL`]); each pause is a random part of it, cut
        /// to the end of the wait. Where the engine tells of releases, that is the fast
        /// path, and this only bounds the cost of a missed one.
        pub fn poll_interval(mut self, interval: std::time::Duration) -> Self {
            self.$($path).+.poll_interval = interval;
            self
        }
        $crate::backend::settings::lease_settings!($($path).+; $($rest)*);
    };
    ($($path:ident).+; prefix $($rest:ident)*) => {
        /// The start of every name the backend gives the server (default
        /// [`DEFAULT_PREFIX`]): applications that share a server keep apart by prefix.
        /// The engine's separator is added where missing; a prefix the engine cannot
        /// use is refused by [`build`](Self::build) (see the module docs).
        pub fn prefix(mut self, prefix: &str) -> Self {
            self.$($path).+.prefix = prefix.to_owned();
            self
        }
        $crate::backend::settings::lease_settings!($($path).+; $($rest)*);
    };
}

pub(crate) use lease_settings;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::setup_error::assert_invalid;

    static TEST: Defaults = Defaults {
        engine: "Test",
        lease: Duration::from_secs(30),
        leases: Duration::from_secs(1)..=Duration::from_secs(60),
        command_timeout: Duration::from_secs(1),
        poll_interval: Duration::from_secs(1),
        prefix: "locks",
        prefix_rule: |prefix| match prefix.contains('!') {
            true => Err("holds a !".into()),
            false => Ok(format!("{prefix}:")),
        },
    };

    #[test]
    fn the_defaults_pass_and_the_prefix_is_settled() {
        let settings = Settings::new(&TEST).check().unwrap();
        assert_eq!(settings.prefix, "locks:");
        assert_eq!(settings.drift, Some(Duration::from_millis(302)));
        let timing = Settings {
            renewal: false,
            ..settings
        }
        .timing();
        assert!(!timing.renewal);
        assert_eq!(timing.lease, Duration::from_secs(30));
    }

    /// Every lease engine's builder sets these through `lease_settings!`: one test.
    #[test]
    fn the_drift_is_one_percent_of_the_lease_and_two_ms_unless_set() {
        let settings = Settings {
            lease: Duration::from_secs(10),
            ..Settings::new(&TEST)
        };
        assert_eq!(settings.drift(), Duration::from_millis(102));
        let set = Settings {
            drift: Some(Duration::from_millis(7)),
            ..settings
        };
        assert_eq!(set.drift(), Duration::from_millis(7));
    }

    #[test]
    fn each_setting_out_of_range_is_refused_by_name() {
        let base = || Settings::new(&TEST);
        let cases = [
            (
                Settings {
                    lease: Duration::from_millis(999),
                    ..base()
                },
                "lease",
            ),
            (
                Settings {
                    lease: Duration::from_secs(61),
                    ..base()
                },
                "lease",
            ),
            (
                Settings {
                    drift: Some(Duration::from_secs(15)),
                    ..base()
                },
                "drift margin",
            ),
            (
                Settings {
                    command_timeout: Duration::ZERO,
                    ..base()
                },
                "command timeout",
            ),
            (
                Settings {
                    poll_interval: Duration::ZERO,
                    ..base()
                },
                "poll interval",
            ),
            (
                Settings {
                    prefix: "a!".into(),
                    ..base()
                },
                "prefix \"a!\" holds a !",
            ),
        ];
        for (settings, named) in cases {
            assert_invalid(settings.check(), named);
        }
    }
}
