//! Helpers shared by the process and fault tests: `idemstage worker` processes,
//! sending under `Rerun`, signals; and, from the testkit, sending items the way
//! `idemstage enqueue` does, in-process workers and waiting on the database.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection};
use idemstage::pipeline::first_job;
use idemstage::runs::TxError;
use idemstage::{ids::ItemId, ids::TenantId, queue::SendResult};

/// Stage lease and job lease of the worker processes: short, so that a killed or
/// stopped worker's claims and jobs come back within seconds.
pub const STAGE_LEASE_MS: u64 = 1500;

/// Worker processes, killed (SIGKILL) and reaped when dropped, so that a failing
/// test leaves none behind.
pub struct Workers {
    url: String,
    extra: Vec<String>,
    pub children: Vec<Child>,
}

impl Workers {
    pub fn start(url: &str, n: usize, extra: &[&str]) -> Workers {
        let mut w = Workers {
            url: url.to_owned(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            children: Vec::new(),
        };
        for _ in 0..n {
            let child = w.spawn();
            w.children.push(child);
        }
        w
    }

    fn spawn(&self) -> Child {
        worker(
            &self.url,
            &self.extra.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    }

    /// SIGKILLs worker `i` and starts a replacement in its place.
    pub fn kill_and_replace(&mut self, i: usize) {
        self.children[i].kill().unwrap();
        self.children[i].wait().unwrap();
        self.children[i] = self.spawn();
    }

    /// Every worker is still running (none exited or crashed).
    pub fn assert_all_alive(&mut self) {
        for (i, c) in self.children.iter_mut().enumerate() {
            assert!(
                c.try_wait().unwrap().is_none(),
                "worker {i} exited: {:?}",
                c.try_wait()
            );
        }
    }

    /// SIGTERM to all; each must exit 0 (graceful shutdown).
    pub fn stop_all(&mut self) {
        for c in &self.children {
            signal(c, "-TERM");
        }
        for c in &mut self.children {
            let status = wait_exit(c, 60);
            assert!(status.success(), "worker exit status {status:?}");
        }
        self.children.clear();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An `idemstage worker` on `url`'s database, connected as the tests' worker login
/// role (`idemstage_testkit::worker_url`), as a deployed worker connects.
pub fn worker(url: &str, extra: &[&str]) -> Child {
    let url = idemstage_testkit::worker_url(url);
    Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["worker", "--concurrency", "4"])
        .args(["--stage-lease-ms", &STAGE_LEASE_MS.to_string()])
        .args(["--job-lease-ms", &JOB_LEASE_MS.to_string()])
        .args(extra)
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start idemstage worker")
}

/// Sends an item as `send` does, under the `Rerun` policy: another text for a
/// registered item replaces its input (and re-points a live job at it). Returns
/// the error of a transaction that failed (a lock timeout, say) so callers can
/// retry.
pub async fn send_rerun(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: ItemId,
    text: &str,
) -> Result<SendResult, idemstage::db::RepoError> {
    let pipeline = pipeline();
    conn.transaction::<_, TxError, _>(async |conn| {
        let started = idemstage::items::start_in(
            conn,
            tenant,
            &item,
            text,
            idemstage::stage::InputChangePolicy::Rerun,
            |hash| first_job(&pipeline, tenant.clone(), item, hash.to_owned()),
        )
        .await?;
        Ok(started.sent)
    })
    .await
    .map_err(TxError::into_repo)
}

/// Sends `n` items over 3 tenants, each twice. Returns their keys.
pub async fn enqueue(url: &str, n: usize) -> Vec<(TenantId, ItemId)> {
    let mut conn = idemstage::db::connect(url).await.unwrap();
    let mut keys = Vec::new();
    for i in 0..n {
        let tenant = TenantId::parse(&format!("t{}", i % 3)).unwrap();
        let item = ItemId::new();
        for _ in 0..2 {
            send(&mut conn, &tenant, item, &text(i)).await;
        }
        keys.push((tenant, item));
    }
    keys
}

pub use idemstage_harness::example::{
    assert_quiet_and_sound, pipeline, send, start_pipeline_worker, stop_pipeline_worker, text,
    wait_until, JOB_LEASE_MS,
};
pub use idemstage_testkit::count;

pub fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

pub fn wait_exit(child: &mut Child, secs: u64) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(std::time::Instant::now() < deadline, "worker did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `idemstage ARGS` on `url`'s database as `$USER` `user` (the default actor),
/// waited for.
pub fn idemstage_as(url: &str, user: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "error")
        .env("USER", user)
        .output()
        .expect("run idemstage")
}

/// The JSON object a command that succeeded printed.
pub fn stdout_json(out: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}
