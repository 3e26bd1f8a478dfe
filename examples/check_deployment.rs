//! Is this deployment safe for the locks? Runs `DistributedLocks::check_deployment`
//! against the server at a URL and prints each finding: what it saw, why it matters,
//! and the fix.
//!
//! ```text
//! cargo run --example check_deployment --features redis -- redis://127.0.0.1:6379/
//! cargo run --example check_deployment --features postgres -- postgres://app@db/app
//! cargo run --example check_deployment --features mysql -- mysql://app:secret@db/app
//! cargo run --example check_deployment --features etcd -- etcd://127.0.0.1:2379
//! cargo run --example check_deployment --features zookeeper -- zookeeper://127.0.0.1:2181
//! ```
//!
//! `--json` prints the report as JSON instead. The exit status is 0 when no finding
//! breaks a guarantee, 1 when one does, 2 when the backend could not be built.
//!
//! The check reads the server's configuration and takes a few locks under a scratch
//! lock name that nothing else uses; it leaves nothing held.

use std::process::ExitCode;
use std::sync::Arc;

use tower_keyed_lock::{DistributedLocks, LockBackend};

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|arg| arg == "--json");
    let Some(url) = args.iter().find(|arg| !arg.starts_with("--")) else {
        eprintln!("usage: check_deployment <url> [--json]   (redis://, postgres://, mysql://, etcd://, zookeeper://)");
        return ExitCode::from(2);
    };
    let backend = match backend(url).await {
        Ok(backend) => backend,
        Err(error) => {
            eprintln!("check_deployment: the backend could not be built: {error}");
            return ExitCode::from(2);
        }
    };
    let report = DistributedLocks::new("check-deployment", backend)
        .check_deployment()
        .await;
    match json {
        true => println!("{}", report.to_json()),
        false => print!("{report}"),
    }
    match report.is_safe() {
        true => ExitCode::SUCCESS,
        false => ExitCode::FAILURE,
    }
}

type BoxError = Box<dyn std::error::Error>;

/// The backend for `url`'s scheme, built with its defaults: its own setup checks run
/// first, and a refusal (an evicting Redis, a transaction pooler) is the error.
async fn backend(url: &str) -> Result<Arc<dyn LockBackend>, BoxError> {
    // etcd and ZooKeeper take the part after the scheme as their servers.
    #[cfg_attr(
        not(any(feature = "etcd", feature = "zookeeper")),
        allow(unused_variables)
    )]
    let (scheme, servers) = url.split_once("://").unwrap_or((url, ""));
    match scheme {
        #[cfg(feature = "redis")]
        "redis" | "rediss" => Ok(Arc::new(tower_keyed_lock::RedisBackend::connect(url).await?)),
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => Ok(Arc::new(
            tower_keyed_lock::backend::postgres::PostgresBackend::connect(url).await?,
        )),
        #[cfg(feature = "mysql")]
        "mysql" => Ok(Arc::new(
            tower_keyed_lock::backend::mysql::MySqlBackend::connect(url).await?,
        )),
        #[cfg(feature = "etcd")]
        "etcd" => Ok(Arc::new(
            tower_keyed_lock::backend::etcd::EtcdBackend::connect(servers.split(',').map(|e| format!("http://{e}")))
                .await?,
        )),
        #[cfg(feature = "zookeeper")]
        "zookeeper" => Ok(Arc::new(
            tower_keyed_lock::backend::zookeeper::ZooKeeperBackend::connect(servers).await?,
        )),
        other => Err(format!(
            "no engine for `{other}://` in this build: build with its feature (--features redis, postgres, mysql, etcd or zookeeper)"
        )
        .into()),
    }
}
