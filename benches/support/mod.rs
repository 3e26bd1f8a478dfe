//! Helpers shared by the bench binaries: CPU time, quantiles, where results go;
//! `engine`: measuring a distributed backend; `round_trips`: counting them on the wire;
//! `redis_pair`: the bare safe Redis pair the Redis benches measure against;
//! `hot_key`: one key hammered by many tasks, two ways side by side.
#![allow(dead_code)]

pub mod engine;
pub mod hot_key;
pub mod redis_pair;
pub mod round_trips;
#[path = "../../tests/support/tcp_proxy.rs"]
pub mod tcp_proxy;
// The tests' server launchers: the reference engines every backend is measured beside.
#[path = "../../tests/support/pg_server.rs"]
pub mod pg_server;
#[path = "../../tests/support/ports.rs"]
pub mod ports;
#[path = "../../tests/support/process.rs"]
pub mod process;
#[path = "../../tests/support/redis_server.rs"]
pub mod redis_server;

/// On-CPU nanoseconds of all live threads of this process (`schedstat`'s first field;
/// the kernel updates it at scheduler ticks, so batches last tens of milliseconds).
pub fn process_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok())
        .filter_map(|stat| stat.split(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The values at quantiles `qs` (nearest rank) of `samples`, 0 for none. Sorts them.
pub fn percentiles_f64<const N: usize>(samples: &mut [f64], qs: [f64; N]) -> [f64; N] {
    samples.sort_unstable_by(f64::total_cmp);
    qs.map(|q| match samples.len() {
        0 => 0.0,
        n => samples[((n - 1) as f64 * q).round() as usize],
    })
}

/// Where criterion writes its results: `$CRITERION_HOME`, `$CARGO_TARGET_DIR/criterion`,
/// else the workspace's `target/criterion` (cargo runs benchmarks from the package root,
/// `benches/`, where a relative `target` would be another folder).
pub fn criterion_dir() -> std::path::PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return home.into();
    }
    let workspace_target = concat!(env!("CARGO_MANIFEST_DIR"), "/../target");
    let target = std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| workspace_target.into());
    std::path::PathBuf::from(target).join("criterion")
}

/// Writes `lines` (JSON objects) to `<criterion dir>/tkl-custom/<bench>.jsonl`, where
/// `scripts/bench-charts` reads them; not in test mode (`--test`: figures of one try).
pub fn write_results(bench: &str, quick: bool, lines: &[String]) {
    if quick || lines.is_empty() {
        return;
    }
    let dir = criterion_dir().join("tkl-custom");
    let path = dir.join(format!("{bench}.jsonl"));
    let text: String = lines.iter().map(|line| format!("{line}\n")).collect();
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
        Ok(()) => println!("results written to {}", path.display()),
        Err(error) => eprintln!("could not write {}: {error}", path.display()),
    }
}
