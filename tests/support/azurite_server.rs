//! A real Azure Blob Storage emulator (Azurite's `azurite-blob`, from npm) on a free
//! port of 127.0.0.1, in memory, killed on drop; and the SAS-signed container URLs its
//! clients use (the SDK has no shared-key signing).
//!
//! Azurite is found as `AZURITE_BLOB`, else `azurite-blob` on the `PATH`, else where
//! `scripts/test` installs it (`~/.cache/tower-keyed-lock/azurite`). It runs with
//! `--skipApiVersionCheck`: `azure_storage_blob` 1.1 speaks API version 2026-04-06,
//! newer than the 3.35 release (the last one for Node 20) knows, and the lease,
//! metadata and conditional calls the lock uses are the same in both.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::process::{missing, runs, ServerProcess, TempDir};

/// Azurite's well-known development account and key (public, in Azurite's docs).
pub const ACCOUNT: &str = "devstoreaccount1";
const ACCOUNT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// How long Azurite may take to start on a loaded machine (Node.js loads it in about a
/// second when idle; many tests starting at once on two cores take far longer).
const STARTUP: Duration = Duration::from_secs(90);

pub struct AzuriteServer {
    process: ServerProcess,
}

/// The `azurite-blob` to run, or a panic that says how to install it.
fn azurite_binary() -> PathBuf {
    if let Ok(binary) = std::env::var("AZURITE_BLOB") {
        return PathBuf::from(binary);
    }
    if runs("azurite-blob", &["--version"]) {
        return PathBuf::from("azurite-blob");
    }
    let home = std::env::var("HOME").unwrap_or_default();
    let cached =
        PathBuf::from(home).join(".cache/tower-keyed-lock/azurite/node_modules/.bin/azurite-blob");
    if !cached.exists() {
        missing(
            "`azurite-blob`",
            " (npm package azurite@3.35.0 on Node 20, into ~/.cache/tower-keyed-lock/azurite), \
             or set AZURITE_BLOB to one",
        );
    }
    cached
}

impl AzuriteServer {
    /// Starts Azurite on a free port; panics if it is not installed or does not start.
    pub fn start() -> Self {
        let binary = azurite_binary();
        let process = ServerProcess::new("azurite-blob", TempDir::new("azurite"))
            .command(move |process| {
                let mut command = Command::new(&binary);
                command
                    // Port 0: Azurite binds a free port and says which, so no other
                    // test's server can take it between a look and the bind.
                    .args(["--blobHost", "127.0.0.1", "--blobPort", "0"])
                    .args(["--inMemoryPersistence", "--extentMemoryLimit", "64"])
                    .args(["--skipApiVersionCheck", "--disableTelemetry", "--silent"])
                    // In memory it writes nothing; its working directory is a temporary
                    // one all the same.
                    .current_dir(process.dir());
                command
            })
            .port_announced(|line| {
                let port = line
                    .split("successfully listens on http://127.0.0.1:")
                    .nth(1)?;
                port.trim().parse().ok()
            })
            .ready_within(STARTUP)
            .poll_every(Duration::from_millis(50))
            .start(1);
        AzuriteServer { process }
    }

    pub fn port(&self) -> u16 {
        self.process.port()
    }

    /// The URL of `container` on this server, signed for the lock's calls.
    pub fn container_url(&self, container: &str) -> String {
        container_url(&format!("127.0.0.1:{}", self.port()), container)
    }

    /// Kills the server (SIGKILL: everything in it is gone, like a lost account).
    pub fn kill(&mut self) {
        self.process.kill();
    }
}

/// The URL of `container` of the development account at `host_port` (Azurite's
/// path-style URLs: the account is the first path segment), with an account SAS.
pub fn container_url(host_port: &str, container: &str) -> String {
    format!("http://{host_port}/{ACCOUNT}/{container}?{}", account_sas())
}

/// An account SAS of the development account for the blob service: read, write,
/// delete, list, add and create on services, containers and blobs, over http or
/// https, until 2099. Signed as Azure documents it (API version 2020-12-06 and later:
/// HMAC-SHA256 of nine fields and an empty encryption scope, with the account key).
pub fn account_sas() -> String {
    let (version, permissions, services, types) = ("2022-11-02", "rwdlac", "b", "sco");
    let (expiry, protocols) = ("2099-01-01T00:00:00Z", "https,http");
    let to_sign = format!(
        "{ACCOUNT}\n{permissions}\n{services}\n{types}\n\n{expiry}\n\n{protocols}\n{version}\n\n"
    );
    let base64 = base64::engine::general_purpose::STANDARD;
    let key = base64
        .decode(ACCOUNT_KEY)
        .expect("the account key is base64");
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes any key");
    mac.update(to_sign.as_bytes());
    let signature = base64.encode(mac.finalize().into_bytes());
    format!(
        "sv={version}&ss={services}&srt={types}&sp={permissions}&se={}&spr={}&sig={}",
        encode(expiry),
        encode(protocols),
        encode(&signature)
    )
}

/// Percent-encodes a query value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}
