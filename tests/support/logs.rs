//! `tracing` output captured into a buffer, for tests that assert on log lines.

use std::sync::{Arc, Mutex};

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs `subscriber` for this thread so that it sees every callsite, also those
/// another test's thread reached first.
///
/// `tracing` caches each callsite's interest process-wide, computed once, by the
/// subscriber of the thread that reaches it first: a test running beside this one with
/// no subscriber of its own would pin a span this test asserts on to "never" (seen
/// under load as a missing `keyed_lock.remote` span). A global subscriber that wants
/// everything makes that first answer "always", and the rebuild re-asks the callsites
/// cached before it was set.
fn set_default_seeing_everything(
    subscriber: impl tracing::Subscriber + Send + Sync + 'static,
) -> tracing::subscriber::DefaultGuard {
    static GLOBAL: std::sync::Once = std::sync::Once::new();
    GLOBAL.call_once(|| {
        // Another test of this binary may have set its own first: the rebuild covers it.
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
    });
    let guard = tracing::subscriber::set_default(subscriber);
    tracing::callsite::rebuild_interest_cache();
    guard
}

impl Captured {
    /// Captures every `tracing` event of this thread, down to `debug`, until the guard
    /// drops.
    pub fn install(&self) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .finish();
        set_default_seeing_everything(subscriber)
    }

    /// As [`install`](Self::install), and a line for every span that closes, with
    /// its fields (what was recorded into them included).
    #[allow(dead_code)] // not every binary that includes this file uses it
    pub fn install_with_spans(&self) -> tracing::subscriber::DefaultGuard {
        let writer = self.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::DEBUG)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .finish();
        set_default_seeing_everything(subscriber)
    }

    /// Everything captured so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}
