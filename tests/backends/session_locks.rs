//! What the session-lock engines (PostgreSQL advisory locks, MySQL `GET_LOCK`) promise
//! alike, one test body run on both: a lock the server grants while its answer is on
//! a slow path never overlaps the next holder. The server counts the grant (and the
//! session's idle limit) from when it grants; the holder learns of it only when the
//! answer arrives. A grant counts only from a round trip answered within the command
//! timeout: the late holder is never granted (each grant given back, tried again until
//! its wait ends) or told its lease is lost before the next holder is granted. And a wait cut while the key is held leaves
//! the server's queue at once.
#![cfg(any(feature = "postgres", feature = "mysql"))]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tower_keyed_lock::{Key, LockBackend, LockError};

use crate::support::tcp_proxy::TcpProxy;

/// Long enough for anything that should happen; a test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(10);
const NAME: &str = "orders";

/// One case of the late grant: the late holder's liveness interval and command
/// timeout, how slow its path turns (each way), and how many trials.
#[derive(Clone, Copy, Debug)]
struct LateGrant<V> {
    /// What else the engine varies (PostgreSQL: the lock scope).
    variant: V,
    liveness: Duration,
    command_timeout: Duration,
    delay: Duration,
    trials: usize,
}

/// A session-lock engine's server, as the shared test drives it.
trait SessionLockServer: Sized + Send + Sync {
    type Variant: std::fmt::Debug + Copy + Send + Sync;

    fn start() -> impl Future<Output = Self> + Send;

    fn upstream(&self) -> SocketAddr;

    /// The cases the late-grant test runs.
    fn late_grant_cases() -> Vec<LateGrant<Self::Variant>>;

    /// A backend of `instance` whose connections go to `host_port`: with the case's
    /// liveness interval and command timeout when `tested`, else with settings that
    /// no slow connect on a loaded machine trips (the holders before and after the
    /// late one are not what is tested).
    fn backend(
        &self,
        host_port: &str,
        instance: &str,
        case: &LateGrant<Self::Variant>,
        tested: bool,
    ) -> Arc<dyn LockBackend>;

    /// Whether the acquisition of `instance` waits for its lock in the server now, with
    /// `ahead` other sessions of the trial waiting before it.
    fn waits(&self, instance: &str, ahead: usize) -> impl Future<Output = bool> + Send;
}

fn key(name: &str) -> Key {
    Key::new(name, 64).unwrap()
}

async fn eventually<F: Future<Output = bool>>(what: &str, mut condition: impl FnMut() -> F) {
    let deadline = Instant::now() + PATIENCE;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Takes and gives back a key of its own on `backend` until that works, so that its
/// pool holds a connection: connecting is setup, not what a test with a short command
/// timeout is about, and on a loaded machine a first connect can outlast it.
async fn warm(backend: &dyn LockBackend) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match backend.acquire("warm", &key("warm"), Duration::ZERO).await {
            Ok(lease) => return lease.release().await,
            Err(error) => assert!(Instant::now() < deadline, "never connected: {error}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ms(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1e3)
}

/// B holds a key; A, through the proxy, waits for it in the server; A's path turns
/// slower each way than its command timeout allows for a round trip; C, direct, waits
/// too; B releases. The server may grant A, but A's answer comes late: A is either
/// never granted (each grant's confirmation too slow, the grant given back and tried
/// again until A's wait ends) or told its lease is lost before C is granted. Never both
/// holding unsignalled.
async fn a_grant_answered_late_never_overlaps_the_next_holder<S: SessionLockServer>() {
    let server = S::start().await;
    let direct = server.upstream().to_string();
    for case in S::late_grant_cases() {
        // How much sooner A was told than C entered, for each A granted; how many A
        // were never granted (refused when their wait ended).
        let mut margins = Vec::new();
        let mut refused = 0;
        for trial in 0..case.trials {
            let proxy = TcpProxy::start(server.upstream()).await;
            let a = server.backend(&proxy.host_port(), "late-a", &case, true);
            warm(&*a).await;
            let b = server.backend(&direct, "late-b", &case, false);
            let c = server.backend(&direct, "late-c", &case, false);
            let name = format!("late-{:?}-{:?}-{trial}", case.variant, case.command_timeout);

            let held = b.acquire(NAME, &key(&name), Duration::ZERO).await.unwrap();
            // A waits behind the proxy; when granted it watches its lease at once.
            let acquiring = a.acquire(NAME, &key(&name), Duration::from_secs(4));
            let a_task = tokio::spawn(async move {
                match acquiring.await {
                    Ok(lease) => {
                        let granted_at = Instant::now();
                        let lost = tokio::time::timeout(PATIENCE, lease.signal().lost()).await;
                        Ok((granted_at, lost.map(|()| Instant::now()).ok(), lease))
                    }
                    Err(error) => Err((error, Instant::now())),
                }
            });
            eventually("A waits in the server", || server.waits("late-a", 0)).await;
            proxy.delay(case.delay);
            let acquiring = c.acquire(NAME, &key(&name), Duration::from_secs(9));
            let c_task = tokio::spawn(async move {
                let lease = acquiring.await.expect("C is granted");
                (lease, Instant::now())
            });
            eventually("C waits in the server", || server.waits("late-c", 1)).await;
            let released = Instant::now();
            held.release().await;

            let (c_lease, c_at) = tokio::time::timeout(PATIENCE, c_task)
                .await
                .expect("C was never granted")
                .unwrap();
            let since = |at: Instant| ms(at.duration_since(released));
            let variant = case.variant;
            match a_task.await.unwrap() {
                Ok((a_at, lost_at, _lease)) => {
                    let lost_at = lost_at.unwrap_or_else(|| {
                        panic!("A (granted at +{}) was never told", since(a_at))
                    });
                    assert!(
                        lost_at < c_at,
                        "{variant:?}: C entered at +{}, A entered at +{} and was told at +{}",
                        since(c_at),
                        since(a_at),
                        since(lost_at)
                    );
                    margins.push(c_at.duration_since(lost_at));
                }
                // Never told it holds the key: no overlap, whenever C entered (A's
                // session, closed as it gave up, may be what let C in a moment before
                // A's error came).
                Err((LockError::Backend(error), refused_at)) => {
                    println!(
                        "{variant:?}: A refused at +{} ({error}), C entered at +{}",
                        since(refused_at),
                        since(c_at)
                    );
                    refused += 1;
                }
                Err((other, _)) => panic!("{variant:?}: A failed oddly: {other:?}"),
            }
            c_lease.release().await;
        }
        margins.sort();
        let told = match (margins.first(), margins.last()) {
            (Some(least), Some(most)) => {
                format!(
                    "; the others told {} to {} before C entered",
                    ms(*least),
                    ms(*most)
                )
            }
            _ => String::new(),
        };
        println!(
            "late grant answer, {:?}, {:?} each way, command timeout {:?}: {} of {} trials \
             A never granted{told}",
            case.variant, case.delay, case.command_timeout, refused, case.trials,
        );
    }
}

/// A wait cut while another instance holds the key leaves the server's queue within
/// one command timeout, while the key is still held (MySQL: the backend interrupts
/// its statement; PostgreSQL: the server looks at the closed connection every 50 ms),
/// not at the holder's release: left queued, the dead waiter is granted the key first,
/// and the next holder waits for its close to free it; a burst of cut waits keeps as
/// many server sessions busy.
async fn a_cancelled_wait_leaves_the_queue_while_the_key_is_held<S: SessionLockServer>() {
    let server = S::start().await;
    let direct = server.upstream().to_string();
    let mut gone_after = Vec::new();
    for (number, case) in S::late_grant_cases().into_iter().enumerate() {
        let holder = server.backend(&direct, "cut-holder", &case, false);
        let waiter = server.backend(&direct, "cut-waiter", &case, true);
        // Connected, and (MySQL) with the control connection a release opens: the bound
        // below is the interrupt's, not a connect's.
        warm(&*waiter).await;
        for round in 0..3 {
            let name = format!("cut-{number}-{round}");
            let round = format!(
                "{:?}, {:?}, round {round}",
                case.variant, case.command_timeout
            );
            let held = holder
                .acquire(NAME, &key(&name), Duration::ZERO)
                .await
                .unwrap();
            {
                let mut acquisition = std::pin::pin!(waiter.acquire(NAME, &key(&name), PATIENCE));
                let queued = Instant::now();
                loop {
                    tokio::select! {
                        _ = &mut acquisition => panic!("round {round}: granted a key held elsewhere"),
                        () = tokio::time::sleep(Duration::from_millis(5)) => {}
                    }
                    if server.waits("cut-waiter", 0).await {
                        break;
                    }
                    assert!(
                        queued.elapsed() < PATIENCE,
                        "round {round}: the wait never queued"
                    );
                }
            }
            // Cut (dropped above) while queued.
            let cut = Instant::now();
            while server.waits("cut-waiter", 0).await {
                assert!(
                    cut.elapsed() < case.command_timeout,
                    "round {round}: the cut wait still queued in the server {:?} later",
                    cut.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            gone_after.push(cut.elapsed());
            // Still held: the cut alone ended the wait.
            let busy = holder.acquire(NAME, &key(&name), Duration::ZERO).await;
            assert!(
                matches!(busy, Err(LockError::Timeout)),
                "round {round}: the key was not held any more"
            );
            held.release().await;
        }
    }
    gone_after.sort();
    println!(
        "a cut wait left the queue {} to {} after the cut",
        ms(gone_after[0]),
        ms(gone_after[gone_after.len() - 1])
    );
}

/// `session_locks!(module, Server, "feature")`: the shared tests on one engine.
macro_rules! session_locks {
    ($module:ident, $server:ty, $feature:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_grant_answered_late_never_overlaps_the_next_holder() {
                super::a_grant_answered_late_never_overlaps_the_next_holder::<$server>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_cancelled_wait_leaves_the_queue_while_the_key_is_held() {
                super::a_cancelled_wait_leaves_the_queue_while_the_key_is_held::<$server>().await;
            }
        }
    };
}

session_locks!(postgres, super::Postgres, "postgres");
session_locks!(mysql, super::MySql, "mysql");

/// PostgreSQL advisory locks, in both scopes: 400 ms each way against a 250 ms
/// command timeout (liveness 200 ms), then the default timings with 2.3 s each way.
/// (Before the fix, A was told 150 ms after C was granted, 3 of 3.)
#[cfg(feature = "postgres")]
struct Postgres {
    server: crate::support::pg_server::PgServer,
    admin: tokio_postgres::Client,
}

#[cfg(feature = "postgres")]
impl SessionLockServer for Postgres {
    type Variant = tower_keyed_lock::backend::postgres::LockScope;

    async fn start() -> Self {
        let server = crate::support::pg_server::PgServer::start();
        let admin = crate::postgres_faults::admin(&server).await;
        Postgres { server, admin }
    }

    fn upstream(&self) -> SocketAddr {
        crate::postgres_faults::pg_addr(&self.server)
    }

    fn late_grant_cases() -> Vec<LateGrant<Self::Variant>> {
        use tower_keyed_lock::backend::postgres::{
            LockScope, DEFAULT_COMMAND_TIMEOUT, DEFAULT_LIVENESS_INTERVAL,
        };
        let millis = Duration::from_millis;
        let mut cases = Vec::new();
        for variant in [LockScope::Session, LockScope::Transaction] {
            cases.push(LateGrant {
                variant,
                liveness: millis(200),
                command_timeout: millis(250),
                delay: millis(400),
                trials: crate::postgres_faults::trials(),
            });
            cases.push(LateGrant {
                variant,
                liveness: DEFAULT_LIVENESS_INTERVAL,
                command_timeout: DEFAULT_COMMAND_TIMEOUT,
                delay: millis(2_300),
                trials: 1,
            });
        }
        cases
    }

    fn backend(
        &self,
        host_port: &str,
        instance: &str,
        case: &LateGrant<Self::Variant>,
        tested: bool,
    ) -> Arc<dyn LockBackend> {
        use tower_keyed_lock::backend::postgres::{
            DEFAULT_COMMAND_TIMEOUT, DEFAULT_LIVENESS_INTERVAL,
        };
        let (liveness, command_timeout) = if tested {
            (case.liveness, case.command_timeout)
        } else {
            (DEFAULT_LIVENESS_INTERVAL, DEFAULT_COMMAND_TIMEOUT)
        };
        let backend = crate::postgres_faults::builder(host_port, instance)
            .liveness_interval(liveness)
            .command_timeout(command_timeout)
            .lock_scope(case.variant)
            .build_lazy();
        Arc::new(backend)
    }

    async fn waits(&self, instance: &str, _ahead: usize) -> bool {
        crate::postgres_faults::waits_in_postgres(&self.admin, instance).await
    }
}

/// MariaDB `GET_LOCK`: 400 ms each way against a 500 ms command timeout (liveness
/// 100 ms), the settings of every instance.
#[cfg(feature = "mysql")]
struct MySql(crate::support::mysql_server::MySqlServer);

#[cfg(feature = "mysql")]
impl SessionLockServer for MySql {
    type Variant = ();

    async fn start() -> Self {
        MySql(crate::support::mysql_server::MySqlServer::start())
    }

    fn upstream(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.0.port()))
    }

    fn late_grant_cases() -> Vec<LateGrant<()>> {
        vec![LateGrant {
            variant: (),
            liveness: Duration::from_millis(100),
            command_timeout: Duration::from_millis(500),
            delay: Duration::from_millis(400),
            trials: 1,
        }]
    }

    fn backend(
        &self,
        host_port: &str,
        _instance: &str,
        case: &LateGrant<()>,
        _tested: bool,
    ) -> Arc<dyn LockBackend> {
        let backend = crate::mysql::builder(&self.0.url_via(host_port))
            .liveness_interval(case.liveness)
            .command_timeout(case.command_timeout)
            .build_lazy();
        Arc::new(backend)
    }

    /// MariaDB names no instance in its process list: the sessions of the trial
    /// waiting in `GET_LOCK` are counted instead, `instance`'s being the one past
    /// `ahead`.
    async fn waits(&self, _instance: &str, ahead: usize) -> bool {
        let waiting = self
            .0
            .admin("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE STATE = 'User lock'");
        waiting.trim().parse::<usize>().expect("a count") > ahead
    }
}
