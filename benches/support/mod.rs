//! Helpers shared by the bench binaries: CPU time, quantiles, where results go;
//! `engine`: measuring a distributed backend.
#![allow(dead_code)]

pub mod engine;
// The tests' server launchers: the reference engines every backend is measured beside.
#[path = "../../tests/support/pg_server.rs"]
pub mod pg_server;
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
/// else `target/criterion` (cargo runs benchmarks from the package root).
pub fn criterion_dir() -> std::path::PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return home.into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| "target".into());
    std::path::PathBuf::from(target).join("criterion")
}
