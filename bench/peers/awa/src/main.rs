//! The awa reference for `cargo xtask bench`: the queue tests of
//! `idemstage bench queue` on the same server, printed as one JSON object.
//!
//! usage: DATABASE_URL=postgres://... idemstage-bench-awa [--jobs 20000]
//!        [--concurrency 16] [--fast-workers 256,1024] [--latency-sends 300]
//!        [--latency-gap-ms 20]
//!        DATABASE_URL=postgres://... idemstage-bench-awa pressure --cell <cell>
//!        --rate <jobs/s> [...]: the pressure cells (src/pressure.rs)
//!
//! awa 0.6 (docs/configuration.md of its repository, the crate docs):
//! - enqueue: `insert_with` with `UniqueOpts` by queue and args over the live
//!   states (scheduled, available, running, retryable): a second job with the same
//!   key while one is live is refused (`AwaError::UniqueConflict`), as ours;
//! - the backlog: `insert_many_copy_from_pool` (COPY) in batches of 1,000;
//! - worker_c16: a `Client` with `QueueConfig { max_workers: 16, .. }`, defaults
//!   otherwise (one claimer, claims of up to `claim_batch_size` 512 jobs,
//!   completions batched by the runtime);
//! - fast: `max_workers` from `--fast-workers` (its configuration guide: "for very
//!   high-throughput no-op queues, size max_workers for durable completion latency,
//!   not handler CPU alone", its reference shape needing 1,024 permits), the
//!   default `claim_batch_size` (512) and one claimer (raise claimers "only when a
//!   single claimer cannot keep worker permits full"); the fastest is reported;
//! - latency: a `Client` at max_workers 16, woken by its LISTEN/NOTIFY.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use awa::{
    Client, InsertOpts, InsertParams, JobArgs, JobResult, JobState, QueueConfig, UniqueOpts,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

mod pressure;

#[derive(Serialize, Deserialize, JobArgs)]
struct BenchJob {
    i: u64,
}

#[derive(Serialize, Deserialize, JobArgs)]
struct EnqueueJob {
    k: u64,
}

fn flag(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn number(name: &str, default: u64) -> anyhow::Result<u64> {
    flag(name).map_or(Ok(default), |v| {
        v.parse().with_context(|| format!("{name} {v:?}"))
    })
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Handler calls per job id.
#[derive(Default)]
struct Ledger {
    ids: Mutex<HashSet<i64>>,
    calls: AtomicU64,
    duplicates: AtomicU64,
}

impl Ledger {
    fn handle(&self, id: i64) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if !self.ids.lock().unwrap().insert(id) {
            self.duplicates.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn seen(&self) -> u64 {
        self.ids.lock().unwrap().len() as u64
    }
}

/// The jobs of `queue` completed, as awa's read-only inspection surface
/// (`awa.terminal_jobs`) has them. Not a clock: it takes seconds here.
async fn completed_in(pool: &PgPool, queue: &str) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM awa.terminal_jobs WHERE queue = $1 AND state = 'completed'",
    )
    .bind(queue)
    .fetch_one(pool)
    .await?;
    Ok(n as u64)
}

/// The jobs of `queue` that are live (scheduled, available, running, retryable),
/// as awa's admin API counts them: the enqueue test's distinct jobs.
async fn live_in(pool: &PgPool, queue: &str) -> anyhow::Result<u64> {
    Ok(awa::admin::queue_overview(pool, queue)
        .await?
        .map_or(0, |q| q.total_queued as u64))
}

struct Drain {
    per_s: f64,
    completed: u64,
    handled: u64,
    duplicates: u64,
}

/// `jobs` jobs on a fresh queue, worked off by a `Client` with `config` and a
/// no-op handler: jobs/s from `start()` to the last completion in the database.
async fn worker_drain(
    pool: &PgPool,
    label: &str,
    jobs: u64,
    config: QueueConfig,
) -> anyhow::Result<Drain> {
    let queue = format!("bench_{label}_{}", std::process::id());
    let mut next = 0;
    while next < jobs {
        let batch: Vec<InsertParams> = (next..jobs.min(next + 1000))
            .map(|i| InsertParams {
                kind: BenchJob::kind().to_owned(),
                args: json!({ "i": i }),
                opts: InsertOpts {
                    queue: queue.clone(),
                    ..InsertOpts::default()
                },
            })
            .collect();
        next += batch.len() as u64;
        awa::insert_many_copy_from_pool(pool, &batch).await?;
    }
    sqlx::query("VACUUM ANALYZE").execute(pool).await?;
    let ledger = Arc::new(Ledger::default());
    let handler_ledger = ledger.clone();
    let client = Client::builder(pool.clone())
        .queue(&queue, config)
        .register::<BenchJob, _, _>(move |_args, ctx| {
            handler_ledger.handle(ctx.job.id);
            async { Ok(JobResult::Completed) }
        })
        .build()?;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(300);
    client.start().await?;
    while ledger.seen() < jobs && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The clock stops when shutdown() returns: it stops claiming and waits for the
    // jobs in flight, their completions written. (Counting completions in the
    // database takes seconds here, so it is no clock.) This errs against awa by its shutdown.
    let handled_after = started.elapsed();
    client.shutdown(Duration::from_secs(30)).await;
    let elapsed = started.elapsed();
    eprintln!(
        "awa {label}: handlers done after {:.3} s, shutdown returned after {:.3} s",
        handled_after.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    // What the database says, untimed.
    let probe = Instant::now();
    let completed = completed_in(pool, &queue).await?;
    eprintln!(
        "awa {label}: completed jobs counted in {:.3} s",
        probe.elapsed().as_secs_f64()
    );
    Ok(Drain {
        per_s: round1(completed as f64 / elapsed.as_secs_f64()),
        completed,
        handled: ledger.calls.load(Ordering::Relaxed),
        duplicates: ledger.duplicates.load(Ordering::Relaxed),
    })
}

fn drain_violations(label: &str, jobs: u64, d: &Drain) -> Vec<String> {
    let mut v = Vec::new();
    if d.completed != jobs {
        v.push(format!(
            "{label}: {} of {jobs} jobs completed in the database",
            d.completed
        ));
    }
    if d.handled != jobs {
        v.push(format!(
            "{label}: {} handler calls for {jobs} jobs",
            d.handled
        ));
    }
    if d.duplicates > 0 {
        v.push(format!("{label}: {} jobs handled twice", d.duplicates));
    }
    v
}

/// Migrates a fresh schema and starts a worker once, before any job exists: the
/// first runtime of a fresh install moves it from the canonical engine to queue
/// storage, 0.6's engine (a database that already holds jobs stays canonical
/// until an operator's staged transition).
async fn fresh_install(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::query("DROP SCHEMA IF EXISTS awa CASCADE")
        .execute(pool)
        .await?;
    awa::migrations::run(pool).await?;
    let client = Client::builder(pool.clone())
        .queue("bench_install", QueueConfig::default())
        .register::<BenchJob, _, _>(|_args, _ctx| async { Ok(JobResult::Completed) })
        .build()?;
    client.start().await?;
    client.shutdown(Duration::from_secs(5)).await;
    let engine: String =
        sqlx::query_scalar("SELECT current_engine FROM awa.storage_transition_state")
            .fetch_one(pool)
            .await?;
    if engine != "queue_storage" {
        bail!("awa runs on its {engine} engine, not queue storage");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("pressure") => return pressure::main(&args[2..]).await,
        Some("pressure-worker") => return pressure::worker_main(&args[2..]).await,
        _ => {}
    }
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let jobs = number("--jobs", 20_000)?;
    let concurrency = number("--concurrency", 16)? as u32;
    let latency_sends = number("--latency-sends", 300)?;
    let latency_gap = Duration::from_millis(number("--latency-gap-ms", 20)?);
    let fast_workers: Vec<u32> = flag("--fast-workers")
        .unwrap_or_else(|| "256,1024".into())
        .split(',')
        .map(|n| n.parse().context("--fast-workers"))
        .collect::<anyhow::Result<_>>()?;

    let connect = || {
        PgPoolOptions::new()
            .max_connections(concurrency + 8)
            .connect(&url)
    };
    let mut pool = connect().await?;
    // Whatever an earlier run or another awa version left (the benchmark database
    // is disposable).
    fresh_install(&pool).await?;
    let mut violations = Vec::new();

    // (a) enqueue: send i uses key i mod jobs/2, so the second half is refused.
    let keys = jobs.div_ceil(2);
    let live = [
        JobState::Scheduled,
        JobState::Available,
        JobState::Running,
        JobState::Retryable,
    ]
    .iter()
    .fold(0u8, |bits, s| bits | (1 << s.bit_position()));
    let queue = format!("bench_enqueue_{}", std::process::id());
    let next = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (pool, next, refused, queue) =
            (pool.clone(), next.clone(), refused.clone(), queue.clone());
        senders.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= jobs {
                    return anyhow::Ok(());
                }
                let opts = InsertOpts {
                    queue: queue.clone(),
                    unique: Some(UniqueOpts {
                        by_queue: true,
                        by_args: true,
                        by_period: None,
                        states: live,
                    }),
                    ..InsertOpts::default()
                };
                match awa::insert_with(&pool, &EnqueueJob { k: i % keys }, opts).await {
                    Ok(_) => {}
                    Err(awa::AwaError::UniqueConflict { .. }) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        });
    }
    while let Some(r) = senders.join_next().await {
        r??;
    }
    let enqueue_s = started.elapsed().as_secs_f64();
    let probe = Instant::now();
    let distinct = live_in(&pool, &queue).await?;
    eprintln!(
        "awa enqueue: live jobs counted in {:.3} s",
        probe.elapsed().as_secs_f64()
    );
    if distinct != keys {
        violations.push(format!("enqueue created {distinct} jobs, expected {keys}"));
    }
    // Out of the way of the drains, on a new pool: the old connections' cached
    // statements name the dropped types.
    pool.close().await;
    pool = connect().await?;
    fresh_install(&pool).await?;

    // (b) the backlog worked off by a Client with a no-op handler.
    let c16 = worker_drain(
        &pool,
        "worker_c16",
        jobs,
        QueueConfig {
            max_workers: concurrency,
            ..QueueConfig::default()
        },
    )
    .await?;
    violations.extend(drain_violations("worker_c16", jobs, &c16));
    let mut fast = Vec::new();
    for &workers in &fast_workers {
        let label = format!("fast_{workers}");
        let d = worker_drain(
            &pool,
            &label,
            jobs,
            QueueConfig {
                max_workers: workers,
                ..QueueConfig::default()
            },
        )
        .await?;
        violations.extend(drain_violations(&label, jobs, &d));
        fast.push((workers, d));
    }
    let (fast_workers_best, fastest) = fast
        .iter()
        .max_by(|a, b| a.1.per_s.total_cmp(&b.1.per_s))
        .context("no fast drain ran")?;

    // (c) pickup latency to an idle Client, woken by NOTIFY.
    let queue = format!("bench_latency_{}", std::process::id());
    let handled: Arc<Mutex<std::collections::HashMap<u64, Instant>>> = Arc::default();
    let handler_seen = handled.clone();
    let client = Client::builder(pool.clone())
        .queue(
            &queue,
            QueueConfig {
                max_workers: concurrency,
                ..QueueConfig::default()
            },
        )
        .register::<BenchJob, _, _>(move |args, _ctx| {
            handler_seen.lock().unwrap().insert(args.i, Instant::now());
            async { Ok(JobResult::Completed) }
        })
        .build()?;
    client.start().await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut sent = Vec::new();
    for i in 0..latency_sends {
        let opts = InsertOpts {
            queue: queue.clone(),
            ..InsertOpts::default()
        };
        awa::insert_with(&pool, &BenchJob { i }, opts).await?;
        sent.push((i, Instant::now()));
        tokio::time::sleep(latency_gap).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while (handled.lock().unwrap().len() as u64) < latency_sends && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    client.shutdown(Duration::from_secs(10)).await;
    let mut ms: Vec<f64> = {
        let handled = handled.lock().unwrap();
        sent.iter()
            .filter_map(|(i, at)| {
                handled
                    .get(i)
                    .map(|h| h.saturating_duration_since(*at).as_secs_f64() * 1000.0)
            })
            .collect()
    };
    ms.sort_by(f64::total_cmp);
    if ms.len() as u64 != latency_sends {
        violations.push(format!(
            "latency: {} of {latency_sends} jobs reached a handler",
            ms.len()
        ));
    }

    let mut report = json!({
        "peer": "awa",
        "version": env!("AWA_VERSION"),
        "enqueue_mode": "unique by queue and args, live states",
        "sends": jobs,
        "enqueue_per_s": round1(jobs as f64 / enqueue_s),
        "duplicates_refused": refused.load(Ordering::Relaxed),
        "distinct_jobs_created": distinct,
        "worker_c16_per_s": c16.per_s,
        "worker_c16_config": format!("Client max_workers {concurrency}, defaults"),
        "fast_per_s": fastest.per_s,
        "fast_config": format!("Client max_workers {fast_workers_best}, claim_batch_size 512, 1 claimer"),
        "latency_samples": ms.len(),
        "latency_ms_p50": round3(quantile(&ms, 0.5)),
        "latency_ms_p99": round3(quantile(&ms, 0.99)),
        "violations": violations,
    });
    for (workers, d) in &fast {
        report[format!("fast_per_s_workers_{workers}")] = json!(d.per_s);
    }
    println!("{}", serde_json::to_string(&report)?);
    if !violations.is_empty() {
        bail!("awa: {}", violations.join("; "));
    }
    Ok(())
}
