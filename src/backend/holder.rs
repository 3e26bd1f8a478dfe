//! Who holds a key: [`Holder`], what [`LockBackend::holder`](super::LockBackend::holder)
//! reads without acquiring, and the default [instance id](default_instance_id) every
//! grant records.

use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The holder of a key as the engine sees it now, read without taking or extending the
/// lock: for operators, and for "skip: instance web-2:4242 is running this job since
/// 09:00:01" logs. Every field is `None` where the engine cannot tell (each engine's
/// module docs say which).
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use tower_keyed_lock::backend::Holder;
///
/// let holder = Holder::new()
///     .with_instance("web-2:4242")
///     .with_since(UNIX_EPOCH + Duration::from_secs(1_795_683_601))
///     .with_fencing_token(17)
///     .with_lease_left(Duration::from_millis(8_200));
/// assert_eq!(holder.instance(), Some("web-2:4242"));
/// assert_eq!(
///     holder.to_string(),
///     "held by web-2:4242 since 2026-11-26T09:00:01Z (fencing token 17, lease left 8.2s)"
/// );
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    instance: Option<String>,
    since: Option<SystemTime>,
    fencing_token: Option<u64>,
    lease_left: Option<Duration>,
}

impl Holder {
    /// A holder about which nothing is known yet (a backend fills in what it can).
    pub fn new() -> Self {
        Self::default()
    }

    /// Names the holding instance (its backend's `instance_id`).
    pub fn with_instance(mut self, instance: impl Into<String>) -> Self {
        self.instance = Some(instance.into());
        self
    }

    /// When the current holder was granted the key, on the wall clock of whoever
    /// recorded it (the engine, or the holder).
    pub fn with_since(mut self, since: SystemTime) -> Self {
        self.since = Some(since);
        self
    }

    /// The fencing token issued with the current grant.
    pub fn with_fencing_token(mut self, fencing_token: u64) -> Self {
        self.fencing_token = Some(fencing_token);
        self
    }

    /// How long the lease has left as the engine sees it now (before a renewal).
    pub fn with_lease_left(mut self, lease_left: Duration) -> Self {
        self.lease_left = Some(lease_left);
        self
    }

    /// The instance id of the holder, if the engine recorded one.
    pub fn instance(&self) -> Option<&str> {
        self.instance.as_deref()
    }

    /// When the current holder was granted the key (wall clock), if known.
    pub fn since(&self) -> Option<SystemTime> {
        self.since
    }

    /// The fencing token of the current grant, if the engine issues them.
    pub fn fencing_token(&self) -> Option<u64> {
        self.fencing_token
    }

    /// What is left of the lease as the engine sees it now, if it has one.
    pub fn lease_left(&self) -> Option<Duration> {
        self.lease_left
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "held by {}",
            self.instance.as_deref().unwrap_or("an unknown instance")
        )?;
        if let Some(since) = self.since {
            write!(f, " since ")?;
            write_utc(f, since)?;
        }
        let mut details = Vec::new();
        if let Some(token) = self.fencing_token {
            details.push(format!("fencing token {token}"));
        }
        if let Some(left) = self.lease_left {
            details.push(format!("lease left {:.1}s", left.as_secs_f64()));
        }
        if !details.is_empty() {
            write!(f, " ({})", details.join(", "))?;
        }
        Ok(())
    }
}

/// `time` as RFC 3339 UTC to the second (`2026-11-26T09:00:01Z`); std has no calendar,
/// and a log line needs no more than this.
fn write_utc(f: &mut fmt::Formatter<'_>, time: SystemTime) -> fmt::Result {
    let Ok(since_epoch) = time.duration_since(UNIX_EPOCH) else {
        return write!(f, "before 1970");
    };
    let secs = since_epoch.as_secs();
    let (days, day_secs) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    write!(
        f,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        day_secs / 3600,
        day_secs / 60 % 60,
        day_secs % 60
    )
}

/// Year, month, day of a count of days since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// The instance id a backend records with each grant unless its builder's
/// `instance_id` names one: `<hostname>:<pid>`. The hostname is the `HOSTNAME`
/// environment variable (set by shells and by Kubernetes to the pod name), else
/// `/proc/sys/kernel/hostname` (Linux), else `unknown-host`: std cannot ask the OS
/// portably, and a dependency for that alone is not worth it.
///
/// ```
/// let id = tower_keyed_lock::backend::default_instance_id();
/// assert!(id.ends_with(&format!(":{}", std::process::id())));
/// ```
pub fn default_instance_id() -> String {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let host = std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
            .map(|host| host.trim().to_owned())
            .filter(|host| !host.is_empty())
            .unwrap_or_else(|| "unknown-host".to_owned());
        format!("{host}:{}", std::process::id())
    })
    .clone()
}

/// Milliseconds since the Unix epoch, as engines store a grant time.
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "s3"))]
pub(crate) fn unix_millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    })
}

/// The time `millis` after the Unix epoch.
#[cfg(any(
    feature = "redis",
    feature = "dynamodb",
    feature = "azure-blob",
    feature = "zookeeper",
    feature = "postgres",
    feature = "s3"
))]
pub(crate) fn from_unix_millis(millis: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_reads_well_with_what_is_known() {
        assert_eq!(Holder::new().to_string(), "held by an unknown instance");
        let holder = Holder::new()
            .with_instance("a:1")
            .with_since(UNIX_EPOCH + Duration::from_secs(951_782_400)); // 2000-02-29
        assert_eq!(holder.to_string(), "held by a:1 since 2000-02-29T00:00:00Z");
    }

    #[test]
    fn dates_follow_the_calendar() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(civil_from_days(20_453), (2025, 12, 31));
    }
}
