//! The deployment check's live run on a working engine: every live check passes.

use super::Deployment;
use crate::backend::Verdict;
use crate::DistributedLocks;

/// The live checks the report must hold: what the engine does, not its configuration.
const LIVE: [&str; 4] = ["round_trip", "exclusion", "hand_off", "left_behind"];

/// [`DistributedLocks::check_deployment`] on the deployment's engine: the live run's
/// checks all ran and passed, and tokens went up where the backend issues them. The
/// configuration findings are the engine's own business (a test server set up for
/// speed, without persistence, may well be told so), and are only printed on failure.
pub async fn the_deployment_live_run_passes<D: Deployment>(deployment: &D) {
    let backend = deployment.backend().await;
    let issues_tokens = backend.issues_fencing_tokens();
    let locks = DistributedLocks::new("conformance-deployment", backend);
    let report = locks.check_deployment().await;
    for check in LIVE {
        let finding = report.finding(check).unwrap_or_else(|| {
            panic!("conformance: the live check {check} did not run:\n{report}")
        });
        assert_eq!(
            finding.verdict,
            Verdict::Pass,
            "conformance: the live check {check} did not pass:\n{report}"
        );
    }
    let fencing = report
        .finding("fencing_tokens")
        .unwrap_or_else(|| panic!("conformance: fencing tokens were not checked:\n{report}"));
    let expected = if issues_tokens {
        Verdict::Pass
    } else {
        Verdict::Warn
    };
    assert_eq!(
        fencing.verdict, expected,
        "conformance: fencing tokens:\n{report}"
    );
}
