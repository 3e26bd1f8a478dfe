//! The `metrics` debugging recorder, installed once per test binary, read cumulatively.
//!
//! The debugging recorder resets every counter and gauge and drains every histogram
//! when it is read. Tests of one binary run in parallel and read it whenever they like,
//! so every read goes through [`snapshot`], which folds what was taken into running
//! totals: counters and gauges add up (the crate only increments and decrements its
//! gauges), histograms keep every sample.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, OnceLock};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::CompositeKey;

/// Installs the recorder; later calls return the same one.
pub fn install() -> &'static Snapshotter {
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

/// Every series recorded so far in this test binary, with its running total.
pub fn snapshot() -> Vec<(CompositeKey, DebugValue)> {
    static TOTALS: OnceLock<Mutex<HashMap<CompositeKey, DebugValue>>> = OnceLock::new();
    let mut totals = TOTALS.get_or_init(Mutex::default).lock().unwrap();
    for (key, _, _, taken) in install().snapshot().into_vec() {
        let total = totals.entry(key).or_insert_with(|| match &taken {
            DebugValue::Counter(_) => DebugValue::Counter(0),
            DebugValue::Gauge(_) => DebugValue::Gauge(0.0.into()),
            DebugValue::Histogram(_) => DebugValue::Histogram(Vec::new()),
        });
        match (total, taken) {
            (DebugValue::Counter(sum), DebugValue::Counter(n)) => *sum += n,
            (DebugValue::Gauge(sum), DebugValue::Gauge(n)) => *sum += n,
            (DebugValue::Histogram(all), DebugValue::Histogram(new)) => all.extend(new),
            (total, taken) => panic!("a series changed kind: {total:?} then {taken:?}"),
        }
    }
    totals
        .iter()
        .map(|(key, value)| (key.clone(), copy(value)))
        .collect()
}

/// `DebugValue` is not `Clone`.
fn copy(value: &DebugValue) -> DebugValue {
    match value {
        DebugValue::Counter(n) => DebugValue::Counter(*n),
        DebugValue::Gauge(n) => DebugValue::Gauge(*n),
        DebugValue::Histogram(all) => DebugValue::Histogram(all.clone()),
    }
}

/// The value of counter `metric` with label `name` = `layer` and the `extra` labels
/// (0 if it was never recorded).
pub fn counter(metric: &str, layer: &str, extra: &[(&str, &str)]) -> u64 {
    let mut wanted: BTreeMap<&str, &str> = extra.iter().copied().collect();
    wanted.insert("name", layer);
    snapshot()
        .into_iter()
        .find_map(|(composite, value)| {
            let key = composite.key();
            let labels: BTreeMap<&str, &str> = key.labels().map(|l| (l.key(), l.value())).collect();
            match value {
                DebugValue::Counter(n) if key.name() == metric && labels == wanted => Some(n),
                _ => None,
            }
        })
        .unwrap_or(0)
}
