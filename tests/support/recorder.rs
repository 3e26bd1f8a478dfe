//! The `metrics` debugging recorder, installed once per test binary.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Installs the recorder on first use; every test of the binary reads the same one.
pub fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("no other recorder in this test binary");
        snapshotter
    })
}

/// The value of counter `metric` with label `name` = `layer` and the `extra` labels
/// (0 if it was never recorded).
pub fn counter(metric: &str, layer: &str, extra: &[(&str, &str)]) -> u64 {
    let mut wanted: BTreeMap<&str, &str> = extra.iter().copied().collect();
    wanted.insert("name", layer);
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .find_map(|(composite, _, _, value)| {
            let key = composite.key();
            let labels: BTreeMap<&str, &str> = key.labels().map(|l| (l.key(), l.value())).collect();
            match value {
                DebugValue::Counter(n) if key.name() == metric && labels == wanted => Some(n),
                _ => None,
            }
        })
        .unwrap_or(0)
}
