//! `idemstage bench <scenario>`: throughput and latency of the claim, the queue and
//! the stage worker, printed as a table or one JSON object per scenario. The
//! references (pgbench on the same SQL, pg-boss) are run by `cargo xtask bench`
//! against the same server; see BENCHMARKS.md.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::fixtures;
use anyhow::{bail, Context};
use idemstage::pipeline::first_job;
use idemstage::queue::JobToSend;
use idemstage::queue::LeaseCommit;
use idemstage::runs::{ClaimOutcome, ClaimRequest};
use idemstage::{db::PoolConfig, queue, runs::PgRunRepository};
use idemstage::{
    ids::JobId, ids::StageName, ids::TenantId, ids::WorkerId, queue::SendOptions,
    queue::SendResult, queue::SkipReason, stage::StagePolicy,
};
use idemstage::{
    worker::handler_fn, worker::Counters, worker::HandlerError, worker::JobHandler,
    worker::PipelineWorker, worker::PipelineWorkerConfig, worker::QueueWorker,
    worker::QueueWorkerConfig,
};
use idemstage_example::check_example_pipeline;
use idemstage_example::{self as example, Chaos};
use serde_json::json;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{BadInput, WakeArg};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Claims of fresh keys (insert path) and of succeeded keys (skip path)
    Claim,
    /// Enqueue with singleton keys, batch drain, pickup latency
    Queue,
    /// Items through the four example stages
    Pipeline,
    /// The noisy neighbour: a tenant's backlog against nine quiet tenants, fair
    /// fetch beside FIFO
    Fairness,
    /// Concurrency caps under several worker processes, one of them SIGKILLed
    Caps,
    /// A rate limit on a stage, observed on the database clock
    Rate,
    /// The example pipeline at a fixed offered rate while vacuum is held back
    /// (clean → stress → recovery; see --cell)
    Pressure,
    /// A bulk rerun of the last stage for --items items of one tenant while
    /// another tenant keeps sending
    Bulk,
    /// One item fanned out into --children children, one stage each, then
    /// gathered; --rounds items one after the other: time to the gather and
    /// the gather's latency after the last child
    FanOut,
}

#[derive(clap::Args)]
pub struct Args {
    scenario: Scenario,
    /// Concurrent tasks (claim, enqueue) or stage executions (pipeline)
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Seconds per timed claim phase
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Items through the pipeline
    #[arg(long, default_value_t = 2000)]
    pub items: u64,
    /// Sends in the enqueue test (half of them reuse a queued singleton key) and jobs
    /// in the drain test
    #[arg(long, default_value_t = 20_000)]
    pub jobs: u64,
    /// Jobs leased per fetch in the drain test
    #[arg(long, default_value_t = 256)]
    drain_batch: u32,
    /// Fetch-and-complete loops in the drain test, one run per count; the fastest is
    /// reported as `drain_per_s`
    #[arg(long, value_delimiter = ',', default_value = "2,4,16")]
    drain_loops: Vec<usize>,
    /// Jobs a `QueueWorker` fetches ahead in the second worker drain,
    /// `worker_drain_prefetch_per_s` (it refills when half are left, so a fetch
    /// takes about half this many); the first fetches only for free slots
    /// (prefetch 0, batch = concurrency). The default holds as many jobs as
    /// graphile-worker's fastest configuration (a local queue of 500, 24 running)
    #[arg(long, default_value_t = 512)]
    worker_prefetch: usize,
    /// Sends in the latency test
    #[arg(long, default_value_t = 300)]
    latency_sends: usize,
    /// Pause between two sends of the latency test
    #[arg(long, default_value_t = 20)]
    latency_gap_ms: u64,
    /// fairness: jobs the worker fetches ahead (0: only for free slots)
    #[arg(long, default_value_t = 16)]
    pub fairness_prefetch: usize,
    /// caps: worker processes (each at --concurrency)
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// caps: active jobs of the first stage at most, in all
    #[arg(long, default_value_t = 8)]
    pub stage_cap: u32,
    /// caps: active jobs of the first stage at most, per tenant
    #[arg(long, default_value_t = 3)]
    pub tenant_cap: u32,
    /// caps: items per tenant (three tenants)
    #[arg(long, default_value_t = 300)]
    pub caps_items: u64,
    /// caps: seconds into the run at which one worker is SIGKILLed
    #[arg(long, default_value_t = 2.0)]
    pub kill_after_s: f64,
    /// rate: the first stage's limit, per second
    #[arg(long, default_value_t = 100)]
    pub rate: u32,
    /// fairness: seconds the quiet tenants send for
    #[arg(long, default_value_t = 20.0)]
    pub quiet_s: f64,
    /// pipeline: when the next stage's job wakes its workers (after-commit keeps
    /// the NOTIFY out of the stage's commit)
    #[arg(long, value_enum, default_value_t = WakeArg::AfterCommit)]
    pub wake: WakeArg,
    /// pipeline: jobs the stage worker leases per fetch, keeping twice as many
    /// fetched ahead (`worker --prefetch`): it fetches again when half are left,
    /// so each fetch takes this many. 0: no prefetch, a fetch for the free slots
    #[arg(long, default_value_t = 32)]
    pub pipeline_batch: usize,
    /// pipeline: the worker's pool connects here, a pooler in transaction mode
    /// (PgBouncer in front of the same database), with `--pooler transaction`'s
    /// settings; fixtures, checks and LISTEN stay on the direct URL
    #[arg(long, value_name = "URL")]
    pub pooler_url: Option<String>,
    /// bulk: the other tenant sends an item every this many ms
    #[arg(long, default_value_t = 50)]
    pub bulk_gap_ms: u64,
    /// bulk: items per batch of the bulk rerun
    #[arg(long, default_value_t = 100)]
    pub bulk_batch: u32,
    /// fan-out: children per item
    #[arg(long, default_value_t = 100)]
    pub children: u32,
    /// fan-out: items, one after the other
    #[arg(long, default_value_t = 20)]
    pub rounds: u32,
    #[command(flatten)]
    pub pressure: super::pressure::PressureArgs,
    /// Print one JSON object instead of the table
    #[arg(long)]
    json: bool,
    /// claim only: write the fixtures (items, succeeded runs) and stop, so that
    /// pgbench starts from the same state as the timed run
    #[arg(long)]
    setup_only: bool,
}

/// The claim scenario's items; the pgbench scripts in bench/pgbench/ draw from
/// the same range, so they must change together.
pub const CLAIM_ITEMS: u64 = 10_000;
const TENANT: &str = "bench";
const INPUT: &str = "10 Stk Schrauben M8\n2,5 m Kabel NYM 3x1,5\n4 h Montage";
const SKIP_STAGE: &str = "done";

pub async fn run(url: &str, args: Args) -> anyhow::Result<ExitCode> {
    if args.concurrency == 0
        || args.jobs == 0
        || args.items == 0
        || args.latency_sends == 0
        || args.bulk_gap_ms == 0
        || args.rounds == 0
    {
        return Err(BadInput("counts must be positive".into()).into());
    }
    if !args.kill_after_s.is_finite() || args.kill_after_s < 0.0 {
        return Err(
            BadInput("--kill-after-s must be a number of seconds, at least 0".into()).into(),
        );
    }
    if !args.quiet_s.is_finite() || args.quiet_s <= 0.0 {
        return Err(BadInput("--quiet-s must be positive".into()).into());
    }
    if !args.duration_s.is_finite() || args.duration_s <= 0.0 {
        return Err(BadInput("--duration-s must be positive".into()).into());
    }
    args.pressure.check()?;
    if args.drain_loops.is_empty() || args.drain_loops.contains(&0) {
        return Err(BadInput(format!(
            "--drain-loops {:?}: give one or more loop counts of at least 1, e.g. 2,4,16",
            args.drain_loops
        ))
        .into());
    }
    idemstage::db::migrate_with(url, vec![idemstage_example::MIGRATIONS]).await?;
    let mut conn = idemstage::db::connect(url).await?;
    // Every scenario starts by emptying the tables: never on a database that is not
    // obviously a benchmark database.
    let db = fixtures::current_database(&mut conn).await?;
    if !db.contains("bench") {
        return Err(BadInput(format!(
            "database {db:?}: idemstage bench empties every table, so it only runs on a \
             database whose name contains \"bench\" (cargo xtask bench uses idemstage_bench)"
        ))
        .into());
    }
    drop(conn);
    let report = match args.scenario {
        Scenario::Claim => claim(url, &args).await?,
        Scenario::Queue => queue_bench(url, &args).await?,
        Scenario::Pipeline => pipeline(url, &args).await?,
        Scenario::Fairness => super::fairness::fairness(url, &args).await?,
        Scenario::Caps => super::limits::caps(url, &args).await?,
        Scenario::Rate => super::limits::rate(url, &args).await?,
        Scenario::Pressure => super::pressure::pressure(url, &args).await?,
        Scenario::Bulk => super::bulk::bulk(url, &args).await?,
        Scenario::FanOut => super::fan_out::fan_out(url, &args).await?,
    };
    let failed = report
        .get("violations")
        .and_then(|v| v.as_array())
        .is_some_and(|v| !v.is_empty());
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn print_table(report: &serde_json::Value) {
    let Some(obj) = report.as_object() else {
        return;
    };
    println!(
        "idemstage bench {}",
        obj.get("scenario").and_then(|s| s.as_str()).unwrap_or("?")
    );
    for (k, v) in obj {
        if k != "scenario" {
            println!("  {k:<28} {v}");
        }
    }
}

fn per_s(n: u64, elapsed: Duration) -> f64 {
    round1(n as f64 / elapsed.as_secs_f64())
}

pub(super) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub(super) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Runs `op` from `concurrency` tasks until `duration` has passed; returns the
/// number of operations and the time until the last task stopped.
async fn timed_loop<F, Fut>(
    concurrency: usize,
    duration: Duration,
    op: F,
) -> anyhow::Result<(u64, Duration)>
where
    F: Fn(usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = JoinSet::new();
    for t in 0..concurrency {
        let op = op.clone();
        tasks.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                op(t).await?;
                n += 1;
            }
            anyhow::Ok(n)
        });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        total += r.context("benchmark task")??;
    }
    Ok((total, started.elapsed()))
}

async fn claim(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    fixtures::insert_numbered_items(&mut conn, TENANT, CLAIM_ITEMS, INPUT).await?;
    let input_hash = idemstage::ids::input_hash_of(INPUT.as_bytes());
    fixtures::insert_succeeded_runs(&mut conn, TENANT, CLAIM_ITEMS, SKIP_STAGE, &input_hash)
        .await?;
    fixtures::vacuum_analyze(&mut conn, &["items", "stage_runs", "stage_attempt_ends"]).await?;
    drop(conn);
    if args.setup_only {
        return Ok(json!({ "scenario": "claim", "setup_only": true, "items": CLAIM_ITEMS }));
    }

    let pool = idemstage::db::connect_pool(
        url,
        PoolConfig::default().with_max_size(args.concurrency as u32),
    )
    .await?;
    let repo = Arc::new(PgRunRepository::new(pool));
    let duration = Duration::from_secs_f64(args.duration_s);
    let unexpected = Arc::new(AtomicU64::new(0));
    let tenant = TenantId::parse(TENANT)?;
    let worker = WorkerId::generate();
    let request = move |stage: String, item: u64| -> anyhow::Result<ClaimRequest> {
        Ok(ClaimRequest {
            tenant: tenant.clone(),
            item: fixtures::numbered_item_id(item),
            stage: StageName::parse(&stage)?,
            input_hash: input_hash.clone(),
            worker: worker.clone(),
            policy: StagePolicy::default(),
            upstream: None,
        })
    };

    // Insert path: a fresh stage name per claim (18 random digits, as the pgbench
    // script), on a random one of the items.
    let (inserts, insert_elapsed) = {
        let (repo, unexpected, request) = (repo.clone(), unexpected.clone(), request.clone());
        timed_loop(args.concurrency, duration, move |_| {
            let (repo, unexpected, request) = (repo.clone(), unexpected.clone(), request.clone());
            async move {
                let stage = format!(
                    "s{}",
                    rand::random_range(100_000_000_000_000_000u64..1_000_000_000_000_000_000)
                );
                let req = request(stage, rand::random_range(0..CLAIM_ITEMS))?;
                if !matches!(repo.claim(&req).await?, ClaimOutcome::Claimed { .. }) {
                    unexpected.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
        })
        .await?
    };
    // Skip path: claims of keys that succeeded.
    let (skips, skip_elapsed) = {
        let (repo, unexpected, request) = (repo.clone(), unexpected.clone(), request.clone());
        timed_loop(args.concurrency, duration, move |_| {
            let (repo, unexpected, request) = (repo.clone(), unexpected.clone(), request.clone());
            async move {
                let req = request(SKIP_STAGE.to_owned(), rand::random_range(0..CLAIM_ITEMS))?;
                if !matches!(
                    repo.claim(&req).await?,
                    ClaimOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
                ) {
                    unexpected.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
        })
        .await?
    };
    let unexpected = unexpected.load(Ordering::Relaxed);
    let mut violations = Vec::new();
    if unexpected > 0 {
        violations.push(format!("{unexpected} claims ended otherwise than expected"));
    }
    Ok(json!({
        "scenario": "claim",
        "clients": args.concurrency,
        "duration_s": args.duration_s,
        "items": CLAIM_ITEMS,
        "insert_claims": inserts,
        "insert_per_s": per_s(inserts, insert_elapsed),
        "skip_claims": skips,
        "skip_per_s": per_s(skips, skip_elapsed),
        "violations": violations,
    }))
}

const ENQUEUE_QUEUE: &str = "bench_enqueue";
const DRAIN_QUEUE: &str = "bench_drain";
const LATENCY_QUEUE: &str = "bench_latency";

async fn queue_bench(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    fixtures::vacuum_analyze(&mut conn, &["jobs"]).await?;
    let mut violations = Vec::new();

    // (a) Enqueue: send i uses key i mod (jobs/2), so the second half of the sends
    // finds its key queued and must be refused.
    let keys = args.jobs.div_ceil(2);
    let next = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut senders = JoinSet::new();
    // Connected before the clock starts, as pg-boss's pool is.
    let mut conns = Vec::new();
    for _ in 0..args.concurrency {
        conns.push(idemstage::db::connect(url).await?);
    }
    let started = Instant::now();
    for mut c in conns {
        let (next, refused, total) = (next.clone(), refused.clone(), args.jobs);
        senders.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return anyhow::Ok(());
                }
                let job = JobToSend {
                    tenant: None,
                    queue: ENQUEUE_QUEUE.into(),
                    payload: json!({ "i": i }),
                    options: SendOptions::default().with_singleton_key(format!("k{}", i % keys)),
                };
                if queue::send_in(&mut c, &job).await? == SendResult::Duplicate {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while let Some(r) = senders.join_next().await {
        r.context("sender task")??;
    }
    let enqueue_elapsed = started.elapsed();
    let distinct = fixtures::count_jobs(&mut conn, ENQUEUE_QUEUE, None).await?;
    if distinct as u64 != keys {
        violations.push(format!("enqueue created {distinct} jobs, expected {keys}"));
    }

    // (b) Drain, once per loop count: the fastest is the result.
    let mut drains = Vec::new();
    for &loops in &args.drain_loops {
        let drain = drain(url, &mut conn, args, loops).await?;
        if drain.completed != args.jobs || drain.in_database as u64 != args.jobs {
            violations.push(format!(
                "drain with {loops} loops completed {} jobs ({} in the database), expected {}",
                drain.completed, drain.in_database, args.jobs
            ));
        }
        drains.push(drain);
    }
    let fastest = drains
        .iter()
        .max_by(|a, b| a.per_s.total_cmp(&b.per_s))
        .context("no drain ran")?;

    // (b2) The backlog again, worked off by a QueueWorker: fetching for free slots
    // only, then fetching ahead, the latter in rounds (a drain lasts about a
    // second, so one run is at the mercy of the machine's noise): its median.
    let mut worker_rounds: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for (i, (prefetch, rounds)) in [(0, 1), (args.worker_prefetch, WORKER_DRAIN_ROUNDS)]
        .into_iter()
        .enumerate()
    {
        for _ in 0..rounds {
            let (per_s, completed) = worker_drain(url, &mut conn, args, prefetch).await?;
            if completed != args.jobs {
                violations.push(format!(
                    "the drain worker with prefetch {prefetch} completed {completed} of {} jobs",
                    args.jobs
                ));
            }
            worker_rounds[i].push(per_s);
        }
    }
    let worker_per_s = worker_rounds.clone().map(median);

    // (c) Pickup latency: sends to an idle worker, from the send's return to the
    // handler's start.
    // Once with the NOTIFY in the send's commit, once with the notifier after it;
    // and the first again with the fetch's commit durable. In rounds, the three
    // modes taking turns (one run's p50 moves by 0.2-0.3 ms with the machine):
    // each mode's median p50 and median p99.
    let modes = [
        (queue::Wake::InCommit, LeaseCommit::default()),
        (queue::Wake::AfterCommit, LeaseCommit::default()),
        (queue::Wake::InCommit, LeaseCommit::Durable),
    ];
    let mut pickup_rounds: [Vec<(f64, f64)>; 3] = Default::default();
    let mut samples = usize::MAX;
    for _ in 0..PICKUP_ROUNDS {
        for (rounds, &(wake, lease)) in pickup_rounds.iter_mut().zip(&modes) {
            fixtures::reset(&mut conn).await?;
            let (p50, p99, got) = pickup_latency(url, args, &mut conn, wake, lease).await?;
            if got != args.latency_sends {
                violations.push(format!(
                    "latency ({wake:?}, {lease:?} leases): {got} of {} jobs reached a handler",
                    args.latency_sends
                ));
            }
            samples = samples.min(got);
            rounds.push((p50, p99));
        }
    }
    let [(p50, p99), (after_p50, after_p99), (durable_p50, durable_p99)] =
        pickup_rounds.each_ref().map(|rounds| {
            (
                median(rounds.iter().map(|r| r.0).collect()),
                median(rounds.iter().map(|r| r.1).collect()),
            )
        });
    let mut report = json!({
        "scenario": "queue",
        "concurrency": args.concurrency,
        "sends": args.jobs,
        "enqueue_per_s": per_s(args.jobs, enqueue_elapsed),
        "duplicates_refused": refused.load(Ordering::Relaxed),
        "distinct_jobs_created": distinct,
        "drain_jobs": fastest.completed,
        "drain_batch": args.drain_batch,
        "drain_loops": fastest.loops,
        "drain_per_s": fastest.per_s,
        "worker_drain_per_s": worker_per_s[0],
        "worker_prefetch": args.worker_prefetch,
        "worker_drain_prefetch_per_s": worker_per_s[1],
        "worker_drain_prefetch_rounds": worker_rounds[1],
        "latency_samples": samples,
        "latency_ms_p50": p50,
        "latency_ms_p99": p99,
        "latency_after_commit_ms_p50": after_p50,
        "latency_after_commit_ms_p99": after_p99,
        "latency_durable_lease_ms_p50": durable_p50,
        "latency_durable_lease_ms_p99": durable_p99,
        "latency_rounds": PICKUP_ROUNDS,
        "latency_ms_rounds": pickup_rounds[0],
        "latency_after_commit_ms_rounds": pickup_rounds[1],
        "latency_durable_lease_ms_rounds": pickup_rounds[2],
        "violations": violations,
    });
    // Flat keys (xtask reads flat objects).
    for d in &drains {
        report[format!("drain_per_s_loops_{}", d.loops)] = json!(d.per_s);
    }
    Ok(report)
}

/// Empties the tables, sends `jobs` jobs to the drain queue in batches of 1,000,
/// then `VACUUM ANALYZE`.
async fn insert_drain_jobs(
    conn: &mut diesel_async::AsyncPgConnection,
    jobs: u64,
) -> anyhow::Result<()> {
    insert_backlog(conn, DRAIN_QUEUE, None, jobs, |i| json!({ "i": i })).await
}

/// Empties the tables, sends `jobs` jobs of `tenant` to `queue` (job `i` with
/// `payload(i)`) in batches of 1,000, then `VACUUM ANALYZE`.
pub(super) async fn insert_backlog(
    conn: &mut diesel_async::AsyncPgConnection,
    queue: &str,
    tenant: Option<&TenantId>,
    jobs: u64,
    payload: impl Fn(u64) -> serde_json::Value,
) -> anyhow::Result<()> {
    fixtures::reset(conn).await?;
    let mut i = 0u64;
    while i < jobs {
        let n = (jobs - i).min(1000);
        let batch: Vec<JobToSend> = (i..i + n)
            .map(|k| JobToSend {
                tenant: tenant.cloned(),
                queue: queue.into(),
                payload: payload(k),
                options: SendOptions::default(),
            })
            .collect();
        queue::send_batch(conn, &batch).await?;
        i += n;
    }
    fixtures::vacuum_analyze(conn, &["jobs"]).await?;
    Ok(())
}

/// Runs of the prefetching worker drain; their median is reported (the peers'
/// fastest configuration gets as many, bench/peers).
const WORKER_DRAIN_ROUNDS: usize = 3;

/// Runs of each pickup measure; the median p50 and p99 are reported.
const PICKUP_ROUNDS: usize = 3;

/// The same backlog worked off by a `QueueWorker` (what an application runs):
/// `concurrency` no-op handlers, each job completed on its own; with `prefetch`,
/// that many jobs fetched ahead, `prefetch` per fetch. Jobs/s from the worker's
/// start to the last completion.
async fn worker_drain(
    url: &str,
    conn: &mut diesel_async::AsyncPgConnection,
    args: &Args,
    prefetch: usize,
) -> anyhow::Result<(f64, u64)> {
    insert_drain_jobs(conn, args.jobs).await?;
    let handler = handler_fn(|_job, _: serde_json::Value| async { Ok::<(), HandlerError>(()) });
    let worker = bench_worker(
        url,
        args,
        DRAIN_QUEUE,
        prefetch,
        LeaseCommit::default(),
        handler,
    )
    .await?;
    let stats = worker.stats();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    // Polled, not timed: the worker's own count says when the backlog is gone.
    let deadline = Instant::now() + Duration::from_secs(600);
    while stats.snapshot().completed < args.jobs && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    shutdown.cancel();
    let done = running.await.context("drain worker")?.completed;
    Ok((per_s(done, elapsed), done))
}

struct Drain {
    loops: usize,
    per_s: f64,
    completed: u64,
    in_database: i64,
}

/// `args.jobs` jobs inserted in batches, `VACUUM ANALYZE`, then `loops` tasks, each
/// on its own connection, repeating `queue::fetch(drain_batch)` +
/// `queue::complete_many` until a fetch comes back empty.
async fn drain(
    url: &str,
    conn: &mut diesel_async::AsyncPgConnection,
    args: &Args,
    loops: usize,
) -> anyhow::Result<Drain> {
    insert_drain_jobs(conn, args.jobs).await?;
    let mut conns = Vec::new();
    for _ in 0..loops {
        conns.push(idemstage::db::connect(url).await?);
    }
    let completed = Arc::new(AtomicU64::new(0));
    let queues = vec![DRAIN_QUEUE.to_owned()];
    let batch_size = args.drain_batch;
    let started = Instant::now();
    let mut drainers = JoinSet::new();
    for mut c in conns {
        let (completed, queues) = (completed.clone(), queues.clone());
        drainers.spawn(async move {
            loop {
                let jobs = queue::fetch(&mut c, &queues, batch_size).await?;
                if jobs.is_empty() {
                    return anyhow::Ok(());
                }
                let tokens: Vec<(JobId, i32)> = jobs.iter().map(|j| (j.id, j.attempt)).collect();
                let outcomes = queue::complete_many(&mut c, &tokens).await?;
                let n = outcomes
                    .iter()
                    .filter(|o| **o == idemstage::queue::JobCompleteOutcome::Completed)
                    .count();
                completed.fetch_add(n as u64, Ordering::Relaxed);
            }
        });
    }
    while let Some(r) = drainers.join_next().await {
        r.context("drain task")??;
    }
    let elapsed = started.elapsed();
    let completed = completed.load(Ordering::Relaxed);
    Ok(Drain {
        loops,
        per_s: per_s(completed, elapsed),
        completed,
        in_database: fixtures::count_jobs(conn, DRAIN_QUEUE, Some("completed")).await?,
    })
}

/// The median of the rounds of one measure (nearest rank: of an odd count, the
/// middle one).
fn median(mut rounds: Vec<f64>) -> f64 {
    rounds.sort_by(f64::total_cmp);
    quantile(&rounds, 0.5)
}

/// The `q`-quantile of sorted samples (nearest rank).
pub(super) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// A `QueueWorker` on `queue` at `--concurrency`, with a pool of its own, leasing
/// up to that many jobs per fetch; with `prefetch`, fetching that many ahead, and
/// up to that many per fetch.
pub(super) async fn bench_worker<H: JobHandler>(
    url: &str,
    args: &Args,
    queue: &str,
    prefetch: usize,
    lease_commit: LeaseCommit,
    handler: H,
) -> anyhow::Result<QueueWorker<H>> {
    let pool = idemstage::db::connect_pool(
        url,
        PoolConfig::default().with_max_size(args.concurrency as u32 + 2),
    )
    .await?;
    Ok(QueueWorker::new(
        pool,
        url,
        QueueWorkerConfig::for_queues([queue])
            .with_concurrency(args.concurrency)
            .with_batch_size(u32::try_from(args.concurrency.max(prefetch)).unwrap_or(u32::MAX))
            .with_prefetch(prefetch)
            .with_lease_commit(lease_commit),
        handler,
    )?)
}

async fn pickup_latency(
    url: &str,
    args: &Args,
    conn: &mut diesel_async::AsyncPgConnection,
    wake: queue::Wake,
    lease_commit: LeaseCommit,
) -> anyhow::Result<(f64, f64, usize)> {
    let started: Arc<Mutex<HashMap<JobId, Instant>>> = Arc::default();
    // Only the after-commit mode has a notifier (its own one-connection pool).
    let notifier = match wake {
        queue::Wake::InCommit => None,
        queue::Wake::AfterCommit => Some(queue::Notifier::new(
            idemstage::db::connect_pool(url, PoolConfig::default().with_max_size(1)).await?,
        )),
    };
    let handler = {
        let started = started.clone();
        handler_fn(move |job, _: serde_json::Value| {
            started.lock().unwrap().insert(job.id, Instant::now());
            async { Ok::<(), HandlerError>(()) }
        })
    };
    let worker = bench_worker(url, args, LATENCY_QUEUE, 0, lease_commit, handler).await?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    // Let the listener connect and the first (empty) fetch pass.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut sent = Vec::with_capacity(args.latency_sends);
    for i in 0..args.latency_sends {
        let job = JobToSend {
            tenant: None,
            queue: LATENCY_QUEUE.into(),
            payload: json!({ "i": i }),
            options: SendOptions::default(),
        };
        let SendResult::Sent(id) = queue::send_in_waking(conn, &job, wake).await? else {
            bail!("a job without a singleton key was refused");
        };
        // The send committed (no transaction is open): the time starts here.
        let at = Instant::now();
        if let Some(notifier) = &notifier {
            notifier.notify(LATENCY_QUEUE);
        }
        sent.push((id, at));
        tokio::time::sleep(Duration::from_millis(args.latency_gap_ms)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while started.lock().unwrap().len() < sent.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    running.await.context("latency worker")?;
    let started = started.lock().unwrap();
    let mut ms: Vec<f64> = sent
        .iter()
        .filter_map(|(id, at)| {
            started
                .get(id)
                // A handler can start before the send's reply is read: that is 0.
                .map(|s| s.saturating_duration_since(*at).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    Ok((
        round3(quantile(&ms, 0.50)),
        round3(quantile(&ms, 0.99)),
        ms.len(),
    ))
}

/// Peak resident set size of this process (VmHWM), in MiB.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(round1(kb / 1024.0))
}

/// Numbered items `0..n` of `tenant` with `input`, and their first stage's jobs
/// (sent in batches of 1,000).
pub(super) async fn seed_items(
    conn: &mut diesel_async::AsyncPgConnection,
    pipeline: &idemstage::pipeline::Pipeline,
    tenant: &str,
    n: u64,
    input: &str,
) -> anyhow::Result<()> {
    fixtures::insert_numbered_items(conn, tenant, n, input).await?;
    let tenant = TenantId::parse(tenant)?;
    let input_hash = idemstage::ids::input_hash_of(input.as_bytes());
    let jobs: Vec<JobToSend> = (0..n)
        .map(|i| {
            first_job(
                pipeline,
                tenant.clone(),
                fixtures::numbered_item_id(i),
                input_hash.clone(),
            )
        })
        .collect();
    for chunk in jobs.chunks(1000) {
        queue::send_batch(conn, chunk).await?;
    }
    Ok(())
}

async fn pipeline(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    let pipeline = example::pipeline(Chaos::default());
    // Every item is feasible, so each runs all four stages.
    seed_items(&mut conn, &pipeline, TENANT, args.items, INPUT).await?;
    fixtures::vacuum_analyze(&mut conn, &["items", "jobs", "stage_runs"]).await?;

    let expected = args.items * pipeline.stages().len() as u64;
    let counters = Arc::new(Counters::default());
    // With a prefetch, a free slot's job is in the buffer already; without, a
    // fetch for the free slots, at most `concurrency`.
    let batch_size = match args.pipeline_batch {
        0 => args.concurrency,
        batch => batch,
    };
    let config = PipelineWorkerConfig::default()
        .with_concurrency(args.concurrency)
        .with_queue(
            QueueWorkerConfig::default()
                .with_batch_size(u32::try_from(batch_size).unwrap_or(u32::MAX))
                .with_prefetch(args.pipeline_batch.saturating_mul(2)),
        )
        .with_wake(args.wake.into());
    let (pool_url, pooler) = match &args.pooler_url {
        Some(pooled) => (pooled.as_str(), idemstage::db::Pooler::Transaction),
        None => (url, idemstage::db::Pooler::None),
    };
    let pool = idemstage::db::connect_pool(
        pool_url,
        PoolConfig::default()
            .with_max_size(config.pool_size())
            .with_pooler(pooler),
    )
    .await?;
    let batch_size = config.queue.batch_size;
    let worker = PipelineWorker::new(pool, url, pipeline, config, counters.clone())?;
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    let deadline = started + Duration::from_secs(600);
    // The tables were analyzed empty above, and a connection keeps the plans
    // it made at its first executions until the next ANALYZE: made while
    // `stage_runs` held a few hundred rows, they read it sequentially. A
    // running system's autovacuum analyzes within a minute, a bench is
    // shorter: analyze once a tenth of the work is done, as it would.
    let warm = (expected / 10).max(1);
    let mut analyzed_after = None;
    loop {
        let done = counters.succeeded.load(Ordering::Relaxed);
        if done >= expected || Instant::now() >= deadline {
            break;
        }
        if analyzed_after.is_none() && done >= warm {
            fixtures::analyze(
                &mut conn,
                &["items", "jobs", "stage_runs", "stage_attempt_ends"],
            )
            .await?;
            analyzed_after = Some(done);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    shutdown.cancel();
    running.await.context("pipeline worker")?;
    let rss = peak_rss_mb();

    let check = check_example_pipeline(&mut conn).await?;
    let mut violations = check.violations();
    let succeeded = counters.succeeded.load(Ordering::Relaxed);
    if succeeded != expected || check.stages_succeeded as u64 != expected {
        violations.push(format!(
            "{succeeded} stage executions reported, {} in the database, expected {expected}",
            check.stages_succeeded
        ));
    }
    Ok(json!({
        "scenario": "pipeline",
        "items": args.items,
        "concurrency": args.concurrency,
        "wake": format!("{:?}", args.wake),
        "prefetch": args.pipeline_batch.saturating_mul(2),
        "batch_size": batch_size,
        "pooler": format!("{pooler:?}"),
        "stage_executions": succeeded,
        "analyzed_after_executions": analyzed_after,
        "wall_s": round3(elapsed.as_secs_f64()),
        "stages_per_s": per_s(succeeded, elapsed),
        "worker_peak_rss_mb": rss,
        "violations": violations,
    }))
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v[..1], 0.99), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
