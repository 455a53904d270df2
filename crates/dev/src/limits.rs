//! `idemstage bench caps` and `idemstage bench rate`: the limits the fetch enforces
//! (the baseline migration), under the workers users run.
//!
//! - caps: `--workers` `idemstage worker` processes (each at `--concurrency`) work
//!   the example pipeline for three tenants while the first stage is capped at
//!   `--stage-cap` active jobs in all and `--tenant-cap` per tenant. A sampler
//!   reads the active jobs per tenant from the database every 2 ms; one worker is
//!   SIGKILLed `--kill-after-s` into the run (its jobs hold their slots until their
//!   leases run out). Reported: the maxima before and after the kill, and the
//!   checker's verdict once every stage of every item succeeded.
//! - rate: one `PipelineWorker` (in this process) works a backlog whose first stage
//!   is limited to `--rate` per second (working that stage only); the claims of
//!   that stage per second are
//!   counted on the database clock over 10 s, after the first 2 s (which include
//!   the bucket's initial burst, reported beside it).

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::db::PoolConfig;
use idemstage::ids::TenantId;
use idemstage::ops::Actor;
use idemstage::pipeline::first_job;
use idemstage::queue::JobToSend;
use idemstage::queue::{self, Limits, Rate, Scope};
use idemstage::{
    worker::Counters, worker::PipelineWorker, worker::PipelineWorkerConfig,
    worker::QueueWorkerConfig,
};
use idemstage_example::{self as example, check_example_pipeline, Chaos};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::bench::{round1, round3, Args};
use super::fixtures;

const INPUT: &str = "10 Stk Schrauben M8\n2,5 m Kabel NYM 3x1,5";
const CAPS_TENANTS: [&str; 3] = ["cap-a", "cap-b", "cap-c"];
/// Up to this much extra work per stage execution, so that slots stay taken long
/// enough for the caps to bind.
const CAPS_STAGE_DELAY_MS: u64 = 100;
/// The workers' job and stage leases: a killed worker's slots (its jobs) and its
/// stages (its claims) come back after them.
const CAPS_JOB_LEASE_MS: u64 = 2000;
const CAPS_STAGE_LEASE_MS: u64 = 2000;
const SAMPLE_GAP: Duration = Duration::from_millis(2);
const RATE_WARMUP: Duration = Duration::from_secs(2);
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// The example pipeline's first stage: the capped and rate-limited queue.
fn first_stage() -> String {
    example::pipeline(Chaos::default()).stages()[0]
        .name()
        .as_str()
        .to_owned()
}

/// Numbered items `0..n` of each tenant, with their first jobs sent, leased
/// for `job_lease` once fetched.
async fn backlog(
    conn: &mut AsyncPgConnection,
    tenants: &[&str],
    n: u64,
    job_lease: Duration,
) -> anyhow::Result<()> {
    let mut send = idemstage::pipeline::Pipeline::default_send_options();
    send.expire_in = job_lease;
    let pipeline = example::pipeline(Chaos::default()).with_send_options(send)?;
    let hash = idemstage::ids::input_hash_of(INPUT.as_bytes());
    for (k, slug) in tenants.iter().enumerate() {
        let from = k as u64 * n;
        fixtures::insert_numbered_items_from(conn, slug, from, n, INPUT).await?;
        let tenant = TenantId::parse(slug)?;
        let jobs: Vec<JobToSend> = (from..from + n)
            .map(|i| {
                first_job(
                    &pipeline,
                    tenant.clone(),
                    fixtures::numbered_item_id(i),
                    hash.clone(),
                )
            })
            .collect();
        for chunk in jobs.chunks(1000) {
            queue::send_batch(conn, chunk).await?;
        }
    }
    fixtures::vacuum_analyze(conn, &["items", "jobs"]).await?;
    Ok(())
}

#[derive(diesel::QueryableByName)]
struct Active {
    #[diesel(sql_type = Text)]
    tenant_id: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The maxima the sampler saw.
#[derive(Default, Clone)]
struct Maxima {
    stage: i64,
    per_tenant: BTreeMap<String, i64>,
    samples: u64,
    /// Samples in which the stage's cap was fully used.
    at_stage_cap: u64,
    /// The sum of the samples' active jobs (for the mean).
    active_sum: i64,
}

impl Maxima {
    fn json(&self, stage_cap: u32) -> serde_json::Value {
        json!({
            "max_active_stage": self.stage,
            "max_active_per_tenant": self.per_tenant,
            "samples": self.samples,
            "mean_active_stage": if self.samples == 0 { 0.0 } else {
                round3(self.active_sum as f64 / self.samples as f64)
            },
            "share_of_samples_at_stage_cap": if self.samples == 0 { 0.0 } else {
                round3(self.at_stage_cap as f64 / self.samples as f64)
            },
            "stage_cap": stage_cap,
        })
    }
}

pub async fn caps(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    if args.workers == 0 || args.stage_cap == 0 || args.tenant_cap == 0 {
        bail!(super::BadInput(
            "--workers, --stage-cap and --tenant-cap must be positive".into()
        ));
    }
    let stage = first_stage();
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    let per_tenant = args.caps_items;
    backlog(
        &mut conn,
        &CAPS_TENANTS,
        per_tenant,
        Duration::from_millis(CAPS_JOB_LEASE_MS),
    )
    .await?;
    queue::set_limits(
        &mut conn,
        &stage,
        &Scope::Queue,
        &Limits {
            max_active: Some(args.stage_cap),
            ..Limits::default()
        },
        &bench_actor(),
    )
    .await?;
    queue::set_limits(
        &mut conn,
        &stage,
        &Scope::EveryTenant,
        &Limits {
            max_active: Some(args.tenant_cap),
            ..Limits::default()
        },
        &bench_actor(),
    )
    .await?;

    let exe = std::env::current_exe().context("the idemstage binary")?;
    let spawn = || -> anyhow::Result<Child> {
        Command::new(&exe)
            .args(["worker", "--concurrency", &args.concurrency.to_string()])
            .args(["--stage-delay-ms", &CAPS_STAGE_DELAY_MS.to_string()])
            .args(["--job-lease-ms", &CAPS_JOB_LEASE_MS.to_string()])
            .args(["--stage-lease-ms", &CAPS_STAGE_LEASE_MS.to_string()])
            // The bench connects as whoever owns its bench database (and empties
            // its tables): its workers do too.
            .arg("--allow-owner")
            .env("DATABASE_URL", url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("spawning idemstage worker")
    };
    let mut workers = (0..args.workers)
        .map(|_| spawn())
        .collect::<anyhow::Result<Vec<_>>>()?;

    let killed = Arc::new(AtomicBool::new(false));
    let stop = CancellationToken::new();
    let sampler = {
        let (url, stage, killed, stop) =
            (url.to_owned(), stage.clone(), killed.clone(), stop.clone());
        let cap = i64::from(args.stage_cap);
        tokio::spawn(async move { sample(&url, &stage, cap, &killed, &stop).await })
    };

    let started = Instant::now();
    let expected = per_tenant * CAPS_TENANTS.len() as u64 * 4;
    let deadline = started + Duration::from_secs(600);
    let kill_at = started + Duration::from_secs_f64(args.kill_after_s);
    let mut killed_at = None;
    loop {
        if killed_at.is_none() && Instant::now() >= kill_at {
            // Child::kill is SIGKILL on Unix: no shutdown path runs.
            workers[0].kill().context("killing a worker")?;
            workers[0].wait()?;
            killed.store(true, Ordering::SeqCst);
            killed_at = Some(started.elapsed());
        }
        let done = fixtures::count_rows(
            &mut conn,
            "SELECT count(*) AS n FROM stage_runs WHERE status = 'success'",
        )
        .await?;
        if done as u64 >= expected || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wall = started.elapsed();
    stop.cancel();
    let (before, after) = sampler.await.context("sampler")??;
    for w in &mut workers[1..] {
        w.kill()?;
        w.wait()?;
    }

    let check = check_example_pipeline(&mut conn).await?;
    let mut violations = check.violations();
    if check.stages_succeeded as u64 != expected {
        violations.push(format!(
            "{} of {expected} stages succeeded within the deadline",
            check.stages_succeeded
        ));
    }
    for (when, m) in [("before the kill", &before), ("after the kill", &after)] {
        if m.stage > i64::from(args.stage_cap) {
            violations.push(format!(
                "{when}: {} active jobs of {stage}, cap {}",
                m.stage, args.stage_cap
            ));
        }
        for (t, n) in &m.per_tenant {
            if *n > i64::from(args.tenant_cap) {
                violations.push(format!(
                    "{when}: {n} active jobs of {stage} for tenant {t}, cap {}",
                    args.tenant_cap
                ));
            }
        }
    }
    Ok(json!({
        "scenario": "caps",
        "stage": stage,
        "workers": args.workers,
        "concurrency_per_worker": args.concurrency,
        "tenants": CAPS_TENANTS.len(),
        "items_per_tenant": per_tenant,
        "stage_cap": args.stage_cap,
        "tenant_cap": args.tenant_cap,
        "stage_delay_ms_max": CAPS_STAGE_DELAY_MS,
        "job_lease_ms": CAPS_JOB_LEASE_MS,
        "stage_lease_ms": CAPS_STAGE_LEASE_MS,
        "killed_worker_at_s": killed_at.map(|d| round3(d.as_secs_f64())),
        "before_kill": before.json(args.stage_cap),
        "after_kill": after.json(args.stage_cap),
        "stages_succeeded": check.stages_succeeded,
        "wall_s": round3(wall.as_secs_f64()),
        "violations": violations,
    }))
}

/// Samples the active jobs of `stage` per tenant until `stop`; the maxima before
/// and after `killed` was set.
async fn sample(
    url: &str,
    stage: &str,
    stage_cap: i64,
    killed: &AtomicBool,
    stop: &CancellationToken,
) -> anyhow::Result<(Maxima, Maxima)> {
    let mut conn = idemstage::db::connect(url).await?;
    let (mut before, mut after) = (Maxima::default(), Maxima::default());
    while !stop.is_cancelled() {
        let rows: Vec<Active> = diesel::sql_query(
            "SELECT tenant_id, count(*) AS n FROM job_states
              WHERE queue = $1 AND state = 'active' GROUP BY tenant_id",
        )
        .bind::<Text, _>(stage)
        .load(&mut conn)
        .await?;
        let m = if killed.load(Ordering::SeqCst) {
            &mut after
        } else {
            &mut before
        };
        let total: i64 = rows.iter().map(|r| r.n).sum();
        m.samples += 1;
        m.active_sum += total;
        m.stage = m.stage.max(total);
        for r in rows {
            let e = m.per_tenant.entry(r.tenant_id).or_default();
            *e = (*e).max(r.n);
        }
        m.at_stage_cap += u64::from(total >= stage_cap);
        // Pacing, not synchronisation: each sample reads the database as it is.
        tokio::time::sleep(SAMPLE_GAP).await;
    }
    Ok((before, after))
}

#[derive(diesel::QueryableByName)]
struct Window {
    #[diesel(sql_type = BigInt)]
    warm: i64,
    #[diesel(sql_type = BigInt)]
    steady: i64,
}

pub async fn rate(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    if args.rate == 0 {
        bail!(super::BadInput("--rate must be positive".into()));
    }
    let stage = first_stage();
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    // Enough that the backlog outlasts the measured window.
    let window_s = (RATE_WARMUP + RATE_WINDOW).as_secs();
    let n = u64::from(args.rate) * (window_s + 3);
    backlog(
        &mut conn,
        &["bench"],
        n,
        idemstage::pipeline::Pipeline::default_send_options().expire_in,
    )
    .await?;
    queue::set_limits(
        &mut conn,
        &stage,
        &Scope::Queue,
        &Limits {
            rate: Some(Rate {
                count: args.rate,
                per: Duration::from_secs(1),
                burst: None,
            }),
            ..Limits::default()
        },
        &bench_actor(),
    )
    .await?;

    let counters = Arc::new(Counters::default());
    // The limited stage only: the stages after it would compete for the same
    // slots, and the machine's capacity, not the limit, would set the rate.
    let config = PipelineWorkerConfig::default()
        .with_concurrency(args.concurrency)
        .with_queue(QueueWorkerConfig::for_queues([stage.clone()]));
    let pool =
        idemstage::db::connect_pool(url, PoolConfig::default().with_max_size(config.pool_size()))
            .await?;
    let pipeline = example::pipeline(Chaos::default());
    let worker = PipelineWorker::new(pool, url, pipeline, config, counters.clone())?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    // The window is measured on the database clock from the first claim; run until
    // it has certainly passed.
    let first = loop {
        let started = fixtures::count_rows(
            &mut conn,
            &format!("SELECT count(*) AS n FROM stage_runs WHERE stage = '{stage}'"),
        )
        .await?;
        if started > 0 {
            break Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep_until((first + RATE_WARMUP + RATE_WINDOW + Duration::from_secs(1)).into())
        .await;
    shutdown.cancel();
    running.await.context("rate worker")?;

    let w: Window = diesel::sql_query(
        "WITH c AS (SELECT a.started_at FROM stage_run_attempts a
                     JOIN stage_runs r ON r.id = a.run_id WHERE r.stage = $1),
              t0 AS (SELECT min(started_at) AS t FROM c)
         SELECT count(*) FILTER (WHERE c.started_at < t0.t + $2 * interval '1 ms') AS warm,
                count(*) FILTER (WHERE c.started_at >= t0.t + $2 * interval '1 ms'
                                   AND c.started_at < t0.t + ($2 + $3) * interval '1 ms')
                    AS steady
           FROM c, t0 GROUP BY t0.t",
    )
    .bind::<Text, _>(&stage)
    .bind::<BigInt, _>(RATE_WARMUP.as_millis() as i64)
    .bind::<BigInt, _>(RATE_WINDOW.as_millis() as i64)
    .get_result(&mut conn)
    .await?;
    let observed = w.steady as f64 / RATE_WINDOW.as_secs_f64();
    let ratio = observed / f64::from(args.rate);
    Ok(json!({
        "scenario": "rate",
        "stage": stage,
        "rate_per_s": args.rate,
        "burst": args.rate,
        "concurrency": args.concurrency,
        "warmup_s": RATE_WARMUP.as_secs(),
        "claims_in_warmup": w.warm,
        "window_s": RATE_WINDOW.as_secs(),
        "claims_in_window": w.steady,
        "observed_per_s": round1(observed),
        "observed_vs_limit": round3(ratio),
        "within_5_percent": (ratio - 1.0).abs() <= 0.05,
        "rate_limited_stage_results": counters.snapshot().rate_limited,
        "violations": Vec::<String>::new(),
    }))
}

/// Who the benches' limits are recorded as set by.
fn bench_actor() -> Actor {
    Actor::parse("idemstage bench").expect("a valid actor")
}
