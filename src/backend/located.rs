//! A backend error that names the engine and where it is before the cause, for the
//! engines whose client errors name neither ("Connection refused (os error 111)",
//! "dispatch failure").

use std::error::Error;
use std::fmt;
use std::sync::Arc;

type BoxError = Box<dyn Error + Send + Sync>;

/// `<engine> at <address>: <error>: <deepest cause>`; its source is `error`.
#[derive(Debug)]
pub(crate) struct Located {
    engine: &'static str,
    /// Where the engine is, as the application may log it: never credentials.
    address: Arc<str>,
    error: BoxError,
}

impl Located {
    pub(crate) fn new(engine: &'static str, address: Arc<str>, error: BoxError) -> Self {
        Self {
            engine,
            address,
            error,
        }
    }
}

impl fmt::Display for Located {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} at {}: {}",
            self.engine,
            self.address,
            with_cause(&*self.error)
        )
    }
}

impl Error for Located {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.error)
    }
}

/// `error`, followed by its deepest source if that says something else ("dispatch
/// failure: Connection refused (os error 111)"). The sources in between are left out:
/// HTTP clients' errors name the request's URL, which may carry a token (a SAS).
pub(crate) fn with_cause(error: &(dyn Error + 'static)) -> String {
    let shown = error.to_string();
    let mut deepest = error.source();
    while let Some(next) = deepest.and_then(|e| e.source()) {
        deepest = Some(next);
    }
    let said = match deepest.map(|cause| cause.to_string()) {
        Some(cause) if !shown.contains(&cause) => format!("{shown}: {cause}"),
        _ => shown,
    };
    without_signatures(&said)
}

/// `text` with the value of every `sig=` (a SAS token's signature, should a URL with
/// its query reach an error's text) replaced by `REDACTED`.
fn without_signatures(text: &str) -> String {
    const SIG: &str = "sig=";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(SIG) {
        out.push_str(&rest[..at + SIG.len()]);
        rest = &rest[at + SIG.len()..];
        let end = rest
            .find(['&', ')', ' ', '"', '\'', '\n'])
            .unwrap_or(rest.len());
        out.push_str("REDACTED");
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("dispatch failure")
        }
    }

    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn the_engine_and_address_come_before_the_deepest_cause() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = Located::new("Engine", "host:1".into(), Box::new(Outer(refused)));
        assert_eq!(
            error.to_string(),
            "Engine at host:1: dispatch failure: refused"
        );
        assert!(error.source().is_some());
        let plain = Located::new("Engine", "host:1".into(), "no answer".into());
        assert_eq!(plain.to_string(), "Engine at host:1: no answer");
    }

    #[test]
    fn sas_signatures_never_show() {
        let leaky = "error sending request for url (http://h/a/c?sv=1&sig=abc%2Bdef&se=2)";
        let error = Located::new("Engine", "host:1".into(), leaky.into());
        assert_eq!(
            error.to_string(),
            "Engine at host:1: error sending request for url \
             (http://h/a/c?sv=1&sig=REDACTED&se=2)"
        );
        assert_eq!(without_signatures("sig=x"), "sig=REDACTED");
    }
}
