//! The load of a cell: the producer at the offered rate, the stress
//! connections, the worker processes and the peak they reach.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use idemstage::db::PoolConfig;
use idemstage::ids::TenantId;
use idemstage::pipeline::first_job;
use idemstage::queue::{self, JobToSend, MaintenanceConfig};
use idemstage::runs::TxError;
use idemstage::worker::{handler_fn, HandlerError, QueueWorker, QueueWorkerConfig};
use idemstage_example::{self as example, Chaos};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::args::{Cell, Workload};
use super::bench::round3;
use super::fixtures;

pub(super) const INPUT: &str = "10 Stk Schrauben M8\n2,5 m Kabel NYM 3x1,5\n4 h Montage";
const TICK: Duration = Duration::from_millis(50);
const READERS: usize = 4;
const READER_GAP: Duration = Duration::from_millis(100);

/// The queue of the no-op workload.
pub const QUEUE: &str = "pressure";

/// Sends units `from..from + n` of `tenant`: items with their first stage's job,
/// or no-op jobs. An item and its job commit together, as a team's `start_in`
/// does: a reconciler's pass between two commits would find the item without a
/// job and send one of its own (harmless, but one job more than the count).
pub(super) async fn send_units(
    conn: &mut AsyncPgConnection,
    workload: Workload,
    tenant: &str,
    from: u64,
    n: u64,
) -> anyhow::Result<()> {
    let tenant_id = TenantId::parse(tenant)?;
    let items = matches!(workload, Workload::Pipeline | Workload::FanOut);
    let jobs: Vec<JobToSend> = if items {
        let pipeline = example::pipeline(Chaos::default());
        let hash = idemstage::ids::input_hash_of(INPUT.as_bytes());
        (from..from + n)
            .map(|i| {
                first_job(
                    &pipeline,
                    tenant_id.clone(),
                    fixtures::numbered_item_id(i),
                    hash.clone(),
                )
            })
            .collect()
    } else {
        (from..from + n)
            .map(|i| JobToSend {
                queue: QUEUE.into(),
                tenant: Some(tenant_id.clone()),
                payload: json!({ "i": i }),
                options: idemstage::queue::SendOptions::default(),
            })
            .collect()
    };
    conn.transaction::<_, TxError, _>(async |conn| {
        if items {
            fixtures::insert_numbered_items_from(conn, tenant, from, n, INPUT).await?;
        }
        for chunk in jobs.chunks(1000) {
            queue::send_batch(conn, chunk).await?;
        }
        Ok(())
    })
    .await
    .map_err(TxError::into_repo)?;
    Ok(())
}

/// `idemstage pressure-worker`: the no-op queue's worker process, a
/// `QueueWorker` on [`QUEUE`] in the drain bench's fastest setting, until
/// SIGTERM or SIGINT (then it stops within the default grace); its maintenance
/// deletes finished jobs after `retention_s` (default 7 days).
pub async fn queue_worker(
    url: &str,
    retention_s: Option<u64>,
) -> anyhow::Result<std::process::ExitCode> {
    let mut config = QueueWorkerConfig::for_queues([QUEUE])
        .with_concurrency(16)
        .with_batch_size(512)
        .with_prefetch(512);
    if let Some(s) = retention_s {
        config = config
            .with_maintenance(MaintenanceConfig::default().with_retention(Duration::from_secs(s)));
    }
    let pool = idemstage::db::connect_pool(url, PoolConfig::default().with_max_size(18)).await?;
    let handler = handler_fn(|_job, _: serde_json::Value| async { Ok::<(), HandlerError>(()) });
    let worker = QueueWorker::new(pool, url, config, handler)?;
    let shutdown = CancellationToken::new();
    let signals = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("install SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            shutdown.cancel();
        })
    };
    worker.run(shutdown).await;
    signals.abort();
    Ok(std::process::ExitCode::SUCCESS)
}

/// Sends items at the rate in `rate` (items/s, f64 bits), credited on wall-clock
/// time, round-robin over the tenants; counts them in `sent`.
pub(super) async fn produce(
    url: String,
    workload: Workload,
    tenants: Vec<String>,
    rate: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut conn = idemstage::db::connect(&url).await?;
    let mut credit = 0.0_f64;
    let mut last = Instant::now();
    let mut next = 0_u64;
    let mut turn = 0_usize;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.is_cancelled() {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => break,
        }
        let now = Instant::now();
        credit += now.duration_since(last).as_secs_f64()
            * f64::from_bits(AtomicU64::load(&rate, Ordering::Relaxed));
        last = now;
        let n = credit.floor() as u64;
        if n == 0 {
            continue;
        }
        credit -= n as f64;
        let k = turn % tenants.len();
        turn += 1;
        send_units(&mut conn, workload, &tenants[k], next, n).await?;
        next += n;
        sent.fetch_add(n, Ordering::Relaxed);
    }
    Ok(())
}

/// The stress connections of a cell, held until `stop`.
pub(super) async fn stress(url: String, cell: Cell, stop: CancellationToken) -> anyhow::Result<()> {
    match cell {
        Cell::IdleInTx => {
            let mut conn = idemstage::db::connect(&url).await?;
            conn.batch_execute("BEGIN; SELECT txid_current();").await?;
            stop.cancelled().await;
            conn.batch_execute("ROLLBACK").await?;
        }
        Cell::ActiveReaders => {
            let mut readers = tokio::task::JoinSet::new();
            for _ in 0..READERS {
                let (url, stop) = (url.clone(), stop.clone());
                readers.spawn(async move {
                    let mut conn = idemstage::db::connect(&url).await?;
                    conn.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                        .await?;
                    while !stop.is_cancelled() {
                        fixtures::count_rows(&mut conn, "SELECT count(*) AS n FROM jobs").await?;
                        tokio::select! {
                            _ = tokio::time::sleep(READER_GAP) => {}
                            _ = stop.cancelled() => {}
                        }
                    }
                    conn.batch_execute("COMMIT").await?;
                    anyhow::Ok(())
                });
            }
            while let Some(r) = readers.join_next().await {
                r??;
            }
        }
        _ => stop.cancelled().await,
    }
    Ok(())
}

/// The workers' peak in units/s: a backlog of `n` units (items with their first
/// jobs, or no-op jobs) sent at once, timed until every job of every unit
/// completed; then emptied again.
pub(super) async fn peak(
    conn: &mut AsyncPgConnection,
    workload: Workload,
    tenants: &[String],
    n: u64,
) -> anyhow::Result<f64> {
    let per_tenant = n.div_ceil(tenants.len() as u64);
    let started = Instant::now();
    for (k, slug) in tenants.iter().enumerate() {
        send_units(conn, workload, slug, k as u64 * per_tenant, per_tenant).await?;
    }
    let expected = (per_tenant * tenants.len() as u64) as f64 * workload.jobs_per_unit();
    let deadline = started + Duration::from_secs(600);
    loop {
        let done = fixtures::count_rows(
            conn,
            "SELECT count(*) AS n FROM job_states WHERE state = 'completed'",
        )
        .await?;
        if done as f64 >= expected {
            break;
        }
        if Instant::now() > deadline {
            anyhow::bail!("the peak's backlog did not drain within 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rate = (per_tenant * tenants.len() as u64) as f64 / started.elapsed().as_secs_f64();
    fixtures::reset(conn).await?;
    fixtures::vacuum_analyze(conn, &["items", "jobs", "stage_runs", "stage_attempt_ends"]).await?;
    Ok(rate)
}

/// The worker processes: `idemstage worker` at its defaults, or the no-op
/// queue's `idemstage pressure-worker`.
pub(super) fn spawn_workers(
    url: &str,
    workload: Workload,
    n: usize,
    prefetch: usize,
    retention_s: Option<u64>,
) -> anyhow::Result<Workers> {
    let exe = std::env::current_exe().context("the idemstage binary")?;
    let prefetch = prefetch.to_string();
    let retention = retention_s.map(|s| s.to_string());
    let args: Vec<&str> = match workload {
        Workload::Pipeline => vec!["worker", "--allow-owner", "--prefetch", &prefetch],
        Workload::FanOut => vec![
            "worker",
            "--allow-owner",
            "--fan-out",
            "--prefetch",
            &prefetch,
        ],
        Workload::Queue => match &retention {
            Some(s) => vec!["pressure-worker", "--retention-s", s],
            None => vec!["pressure-worker"],
        },
    };
    // Pushed one by one: if a spawn fails, the ones before it are killed.
    let mut workers = Workers(Vec::with_capacity(n));
    for _ in 0..n {
        workers.0.push(
            Command::new(&exe)
                .args(&args)
                .env("DATABASE_URL", url)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("spawning idemstage worker")?,
        );
    }
    Ok(workers)
}

/// A run's worker processes. Any still running when it is dropped (a run that
/// ended early with an error, wherever) are killed, so that none outlives
/// the run; [`Workers::stop`] is the run's own end.
pub(super) struct Workers(Vec<Child>);

impl Workers {
    /// SIGTERM to every worker; the seconds until the last exited (`None`: one
    /// had to be killed after its grace).
    pub(super) fn stop(&mut self, grace: Duration) -> anyhow::Result<Option<f64>> {
        stop_workers(&mut self.0, grace)
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.0 {
            if matches!(w.try_wait(), Ok(None)) {
                let _ = w.kill();
                let _ = w.wait();
            }
        }
    }
}

fn stop_workers(workers: &mut [Child], grace: Duration) -> anyhow::Result<Option<f64>> {
    let started = Instant::now();
    for w in workers.iter() {
        Command::new("kill")
            .args(["-TERM", &w.id().to_string()])
            .status()
            .context("kill -TERM")?;
    }
    let mut clean = true;
    for w in workers.iter_mut() {
        loop {
            if w.try_wait()?.is_some() {
                break;
            }
            if started.elapsed() > grace {
                w.kill()?;
                w.wait()?;
                clean = false;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(clean.then(|| round3(started.elapsed().as_secs_f64())))
}
