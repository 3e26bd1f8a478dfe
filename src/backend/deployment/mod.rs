//! The deployment check: "is my setup safe for this lock?", asked of the servers a
//! backend runs on, answered per finding with what was seen, why it matters and the
//! fix. See [`DistributedLocks::check_deployment`](crate::DistributedLocks::check_deployment).
//!
//! Two parts make a report:
//!
//! - the engine's own configuration ([`LockBackend::check_configuration`]): an
//!   evicting Redis, a pooler in front of PostgreSQL, a Galera node, a server clock
//!   far from this machine's, …;
//! - a short live run on the engine through the backend itself, under a scratch lock
//!   name that nothing else uses (`live.rs`): a held key refused to a second
//!   acquisition, fencing tokens that go up, the round trip of a lock and release and
//!   the time a release takes to reach a waiter, and no holder left behind.
//!
//! [`LockBackend::check_configuration`]: super::LockBackend::check_configuration

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, SystemTime};

mod live;

pub(crate) use live::live_run;

/// How a finding bears on the locks' guarantees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Verdict {
    /// As the locks need it.
    Pass,
    /// The locks hold, with a weaker guarantee or a cost worth knowing (a failover
    /// that can lose a lock, a slow round trip).
    Warn,
    /// A guarantee breaks here (two holders at once, a lock dropped before its lease
    /// ends), or the engine could not be checked.
    Fail,
}

impl Verdict {
    /// `"pass"`, `"warn"` or `"fail"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
        }
    }
}

/// One thing the deployment check looked at.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Finding {
    /// A short stable name of what was checked: `"eviction_policy"`, `"exclusion"`, …
    pub check: &'static str,
    /// How it bears on the locks.
    pub verdict: Verdict,
    /// What the check saw.
    pub saw: String,
    /// Why it matters to the locks.
    pub why: Cow<'static, str>,
    /// What to change; `None` when nothing needs to change.
    pub fix: Option<Cow<'static, str>>,
}

impl Finding {
    /// A finding that needs no change.
    pub fn pass(
        check: &'static str,
        saw: impl Into<String>,
        why: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            check,
            verdict: Verdict::Pass,
            saw: saw.into(),
            why: why.into(),
            fix: None,
        }
    }

    /// A finding worth knowing, with what would improve it.
    pub fn warn(
        check: &'static str,
        saw: impl Into<String>,
        why: impl Into<Cow<'static, str>>,
        fix: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            verdict: Verdict::Warn,
            fix: Some(fix.into()),
            ..Self::pass(check, saw, why)
        }
    }

    /// A finding that breaks a guarantee, with the fix.
    pub fn fail(
        check: &'static str,
        saw: impl Into<String>,
        why: impl Into<Cow<'static, str>>,
        fix: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            verdict: Verdict::Fail,
            ..Self::warn(check, saw, why, fix)
        }
    }

    /// The offset of the engine's clock from this machine's, as `clock_offset`: a
    /// warning past [`CLOCK_OFFSET_WARNING`]. `server` is the engine's time, read at
    /// `read_at` (this machine's clock midway through the round trip), give or take
    /// `uncertainty` (half the round trip, plus the server clock's resolution).
    pub fn clock_offset(server: SystemTime, read_at: SystemTime, uncertainty: Duration) -> Self {
        let (offset, sign) = match server.duration_since(read_at) {
            Ok(ahead) => (ahead, "ahead of"),
            Err(behind) => (behind.duration(), "behind"),
        };
        let saw = format!(
            "the server's clock is {} {sign} this machine's (± {})",
            Millis(offset),
            Millis(uncertainty)
        );
        const WHY: &str = "lease expiry and takeover are judged by each side's own clock \
            (no lock here compares clocks across machines), but the times in holder records \
            and logs are the server's, and a clock far off usually means time sync is broken \
            on one side, which also skews leases measured in wall time";
        match offset.saturating_sub(uncertainty) > CLOCK_OFFSET_WARNING {
            true => Self::warn(
                "clock_offset",
                saw,
                WHY,
                "run time sync (chrony, systemd-timesyncd, the cloud's time service) on both machines",
            ),
            false => Self::pass("clock_offset", saw, WHY),
        }
    }
}

/// The `clock_offset` finding of an engine whose answers carry a `Date` (Azure Blob,
/// DynamoDB, S3): the middle of the interval that the answers so far pin the server's
/// clock to, give or take half its width (whole-second dates: about half a second
/// after one answer, a round trip after many).
#[cfg(any(feature = "dynamodb", feature = "azure-blob", feature = "s3"))]
pub(crate) fn clock_offset_seen(clock: &crate::backend::server_clock::ServerClock) -> Finding {
    let now = tokio::time::Instant::now();
    let read_at = SystemTime::now();
    match (clock.at_least(now), clock.at_most(now)) {
        (Some(low), Some(high)) => Finding::clock_offset(
            SystemTime::UNIX_EPOCH + Duration::from_micros(low / 2 + high / 2),
            read_at,
            Duration::from_micros(high.saturating_sub(low) / 2),
        ),
        _ => Finding::warn(
            "clock_offset",
            "not read: no dated answer from the server yet",
            "the check could not tell",
            "run the check again once the engine answers",
        ),
    }
}

/// A server clock further than this from the checking machine's (beyond the
/// measurement's uncertainty) is a warning.
pub const CLOCK_OFFSET_WARNING: Duration = Duration::from_millis(500);

/// What [`DistributedLocks::check_deployment`](crate::DistributedLocks::check_deployment)
/// found: the engine's configuration, then the live run. `Display` writes it as text,
/// one finding per paragraph; [`to_json`](Self::to_json) as JSON.
#[derive(Clone, Debug)]
pub struct DeploymentReport {
    engine: &'static str,
    findings: Vec<Finding>,
}

impl DeploymentReport {
    pub(crate) fn new(engine: &'static str, findings: Vec<Finding>) -> Self {
        Self { engine, findings }
    }

    /// The engine checked: `"redis"`, `"postgres"`, … (`"in-process"` without one).
    pub fn engine(&self) -> &'static str {
        self.engine
    }

    /// Every finding, the configuration's first.
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// The finding of the check named `check`, if it ran.
    pub fn finding(&self, check: &str) -> Option<&Finding> {
        self.findings.iter().find(|finding| finding.check == check)
    }

    /// The worst verdict of all findings.
    pub fn verdict(&self) -> Verdict {
        (self.findings.iter().map(|finding| finding.verdict))
            .max()
            .unwrap_or(Verdict::Pass)
    }

    /// Whether no finding breaks a guarantee.
    pub fn is_safe(&self) -> bool {
        self.verdict() < Verdict::Fail
    }

    /// `{"engine":…,"verdict":…,"findings":[{"check":…,"verdict":…,"saw":…,"why":…,
    /// "fix":…},…]}` (`fix` left out when there is none).
    pub fn to_json(&self) -> String {
        use crate::json_text::push_string;

        let mut json = String::from(r#"{"engine":"#);
        push_string(&mut json, self.engine);
        json += r#","verdict":"#;
        push_string(&mut json, self.verdict().as_str());
        json += r#","findings":["#;
        for (i, finding) in self.findings.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json += r#"{"check":"#;
            push_string(&mut json, finding.check);
            json += r#","verdict":"#;
            push_string(&mut json, finding.verdict.as_str());
            json += r#","saw":"#;
            push_string(&mut json, &finding.saw);
            json += r#","why":"#;
            push_string(&mut json, &finding.why);
            if let Some(fix) = &finding.fix {
                json += r#","fix":"#;
                push_string(&mut json, fix);
            }
            json.push('}');
        }
        json + "]}"
    }
}

impl fmt::Display for DeploymentReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}: {}", self.engine, self.verdict().as_str())?;
        for finding in &self.findings {
            writeln!(f)?;
            writeln!(
                f,
                "[{}] {}: {}",
                finding.verdict.as_str(),
                finding.check,
                finding.saw
            )?;
            writeln!(f, "  why: {}", finding.why)?;
            if let Some(fix) = &finding.fix {
                writeln!(f, "  fix: {fix}")?;
            }
        }
        Ok(())
    }
}

/// A duration in milliseconds with three decimals, for findings.
pub(crate) struct Millis(pub(crate) Duration);

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3} ms", self.0.as_secs_f64() * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> DeploymentReport {
        DeploymentReport::new(
            "redis",
            vec![
                Finding::pass("exclusion", "refused", "two holders"),
                Finding::warn("replicas", "1 \"replica\"", "failover", "use WAIT"),
            ],
        )
    }

    #[test]
    fn the_worst_finding_is_the_verdict() {
        let mut report = report();
        assert_eq!(report.verdict(), Verdict::Warn);
        assert!(report.is_safe());
        report.findings.push(Finding::fail(
            "eviction_policy",
            "allkeys-lru",
            "drops locks",
            "noeviction",
        ));
        assert_eq!(report.verdict(), Verdict::Fail);
        assert!(!report.is_safe());
        assert_eq!(
            report.finding("eviction_policy").unwrap().verdict,
            Verdict::Fail
        );
        assert!(report.finding("nothing").is_none());
    }

    #[test]
    fn text_and_json_say_every_finding() {
        let report = report();
        let text = report.to_string();
        assert!(text.starts_with("redis: warn\n"), "{text}");
        assert!(
            text.contains("[warn] replicas: 1 \"replica\"\n  why: failover\n  fix: use WAIT\n"),
            "{text}"
        );
        assert_eq!(
            report.to_json(),
            r#"{"engine":"redis","verdict":"warn","findings":[{"check":"exclusion","verdict":"pass","saw":"refused","why":"two holders"},{"check":"replicas","verdict":"warn","saw":"1 \"replica\"","why":"failover","fix":"use WAIT"}]}"#
        );
    }

    #[test]
    fn a_clock_offset_within_its_uncertainty_passes() {
        let now = SystemTime::now();
        let near = Finding::clock_offset(
            now + Duration::from_millis(600),
            now,
            Duration::from_millis(200),
        );
        assert_eq!(near.verdict, Verdict::Pass, "{near:?}");
        let far =
            Finding::clock_offset(now - Duration::from_secs(3), now, Duration::from_millis(1));
        assert_eq!(far.verdict, Verdict::Warn, "{far:?}");
        assert!(far.saw.contains("behind"), "{far:?}");
    }
}
