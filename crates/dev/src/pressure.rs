//! `idemstage bench pressure`: the pressure cells of hardbyte's
//! postgresql-job-queue-benchmarking (its docs/method.md), for the example
//! pipeline worked by `--pressure-workers` `idemstage worker` processes.
//!
//! A producer sends items at a fixed offered rate, credited on wall-clock time (a
//! slow tick sends more in the next, so offered work is never lost). Phases: warm-up
//! (sampled, left out of the summary) → clean → stress → recovery; the cell decides the stress: a held transaction with an
//! XID (`idle_in_tx`), four REPEATABLE READ readers scanning `jobs` every 100 ms
//! (`active_readers`), 1.5x (`sustained_high_load`) or 2x (`event_burst`) the
//! offered rate, or nothing (`clean`). Every `--sample-every-s` a sample reads
//! from the database the stage jobs completed in the window and their pickup
//! latencies (fetch minus availability, into a bounded histogram), the backlog,
//! the dead tuples of every table and the size of their indexes. After recovery
//! the backlog must drain within 60 s and the workers stop within their grace.
//! The JSON's shape is shared with the awa reference (bench/peers/awa), so one
//! plot reads both (BENCHMARKS.md).

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use diesel::sql_types::{BigInt, Double, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use hdrhistogram::Histogram;
use idemstage::db::PoolConfig;
use idemstage::ids::TenantId;
use idemstage::pipeline::first_job;
use idemstage::queue::{self, JobToSend};
use idemstage::worker::{handler_fn, HandlerError, QueueWorker, QueueWorkerConfig};
use idemstage_example::{self as example, check_example_pipeline, Chaos};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::bench::{round1, round3, Args};
use super::{fixtures, BadInput};

const INPUT: &str = "10 Stk Schrauben M8\n2,5 m Kabel NYM 3x1,5\n4 h Montage";
const TICK: Duration = Duration::from_millis(50);
const READERS: usize = 4;
const READER_GAP: Duration = Duration::from_millis(100);
const DRAIN_GRACE: Duration = Duration::from_secs(60);
/// The warm-up's samples are reported but left out of the summary (the method's
/// `warmup` phase: start-up artefacts such as the first plans on fresh tables).
const PHASES: [&str; 4] = ["warmup", "clean", "stress", "recovery"];
const CLEAN: usize = 1;
const STRESS: usize = 2;
const RECOVERY: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Cell {
    /// No stress: the stress phase runs at the offered rate
    Clean,
    /// One connection holds a transaction with an XID for the stress phase
    IdleInTx,
    /// Four REPEATABLE READ connections scan `jobs` in one snapshot each
    ActiveReaders,
    /// 1.5x the offered rate
    SustainedHighLoad,
    /// 2x the offered rate (an oversupply around the peak), then catch-up
    EventBurst,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// The example pipeline's four stages per item, `idemstage worker` processes
    Pipeline,
    /// No-op jobs of one queue, `QueueWorker` processes in the drain bench's
    /// fastest setting (concurrency 16, prefetch 512)
    Queue,
    /// The example pipeline with a fan-out (`worker --fan-out`): per item
    /// intake, extract, one feasibility per position (children) and the
    /// gathering calculate
    FanOut,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Pipeline => "pipeline",
            Workload::Queue => "queue",
            Workload::FanOut => "fan-out",
        }
    }

    /// Jobs per unit sent (an item: one per stage; a queue job: one).
    fn jobs_per_unit(self) -> f64 {
        match self {
            Workload::Pipeline => example::pipeline(Chaos::default()).stages().len() as f64,
            Workload::Queue => 1.0,
            // intake, extract, calculate, and one feasibility per position.
            Workload::FanOut => 3.0 + example::extract_positions(INPUT).len() as f64,
        }
    }
}

/// The queue of the no-op workload.
pub const QUEUE: &str = "pressure";

/// Sends units `from..from + n` of `tenant`: items with their first stage's job,
/// or no-op jobs.
async fn send_units(
    conn: &mut AsyncPgConnection,
    workload: Workload,
    tenant: &str,
    from: u64,
    n: u64,
) -> anyhow::Result<()> {
    let tenant_id = TenantId::parse(tenant)?;
    let jobs: Vec<JobToSend> = match workload {
        Workload::Pipeline | Workload::FanOut => {
            fixtures::insert_numbered_items_from(conn, tenant, from, n, INPUT).await?;
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
        }
        Workload::Queue => (from..from + n)
            .map(|i| JobToSend {
                queue: QUEUE.into(),
                tenant: Some(tenant_id.clone()),
                payload: json!({ "i": i }),
                options: idemstage::queue::SendOptions::default(),
            })
            .collect(),
    };
    for chunk in jobs.chunks(1000) {
        queue::send_batch(conn, chunk).await?;
    }
    Ok(())
}

/// `idemstage pressure-worker`: the no-op queue's worker process, a
/// `QueueWorker` on [`QUEUE`] in the drain bench's fastest setting, until
/// SIGTERM or SIGINT (then it stops within the default grace).
pub async fn queue_worker(url: &str) -> anyhow::Result<std::process::ExitCode> {
    let config = QueueWorkerConfig::for_queues([QUEUE])
        .with_concurrency(16)
        .with_batch_size(512)
        .with_prefetch(512);
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

/// `idemstage bench pressure`'s flags.
#[derive(clap::Args)]
pub struct PressureArgs {
    /// pressure: the stress of the cell
    #[arg(long, value_enum, default_value_t = Cell::IdleInTx)]
    pub cell: Cell,
    /// pressure: what the workers work
    #[arg(long, value_enum, default_value_t = Workload::Pipeline)]
    pub workload: Workload,
    /// pressure: items per second offered in the clean and recovery phases (each
    /// item is four stage jobs); default: half the workers' peak, measured first
    /// by draining a backlog of --peak-items
    #[arg(long)]
    pub items_per_s: Option<f64>,
    /// pressure: the backlog (items; the queue workload: four times as many
    /// jobs) whose drain measures the workers' peak
    #[arg(long, default_value_t = 1500)]
    pub peak_items: u64,
    /// pressure: seconds of the warm-up at the offered rate before the clean
    /// phase, sampled but left out of the summary (0: none)
    #[arg(long, default_value_t = 30.0)]
    pub warmup_s: f64,
    /// pressure: seconds of the clean phase
    #[arg(long, default_value_t = 60.0)]
    pub clean_s: f64,
    /// pressure: seconds of the stress phase
    #[arg(long, default_value_t = 240.0)]
    pub stress_s: f64,
    /// pressure: seconds of the recovery phase
    #[arg(long, default_value_t = 120.0)]
    pub recovery_s: f64,
    /// pressure: seconds between two samples
    #[arg(long, default_value_t = 5.0)]
    pub sample_every_s: f64,
    /// pressure: `idemstage worker` processes, each at its default concurrency
    #[arg(long, default_value_t = 2)]
    pub pressure_workers: usize,
    /// pressure: the pipeline workers' `--prefetch` (0: their default, fetching
    /// only for free slots)
    #[arg(long, default_value_t = 0)]
    pub pressure_prefetch: usize,
    /// pressure: tenants the items are sent for, round-robin
    #[arg(long, default_value_t = 4)]
    pub tenants: usize,
}

impl PressureArgs {
    /// Refuses what cannot be measured, before anything touches the database.
    pub fn check(&self) -> Result<(), BadInput> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if ![
            self.clean_s,
            self.stress_s,
            self.recovery_s,
            self.sample_every_s,
        ]
        .into_iter()
        .all(positive)
            || !(positive(self.warmup_s) || self.warmup_s == 0.0)
            || self.items_per_s.is_some_and(|r| !positive(r))
            || self.peak_items == 0
            || self.pressure_workers == 0
            || self.tenants == 0
        {
            return Err(BadInput(
                "pressure: --items-per-s, --peak-items, the phases' seconds, --sample-every-s, \
                 --pressure-workers and --tenants must be positive (--warmup-s may be 0)"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl Cell {
    fn name(self) -> &'static str {
        match self {
            Cell::Clean => "clean",
            Cell::IdleInTx => "idle_in_tx",
            Cell::ActiveReaders => "active_readers",
            Cell::SustainedHighLoad => "sustained_high_load",
            Cell::EventBurst => "event_burst",
        }
    }

    fn multiplier(self) -> f64 {
        match self {
            Cell::SustainedHighLoad => 1.5,
            Cell::EventBurst => 2.0,
            _ => 1.0,
        }
    }
}

/// One window's pickup latencies, in microseconds.
fn histogram() -> Histogram<u64> {
    // Up to an hour at 3 significant figures: a few tens of KiB, whatever the rate.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn quantile_ms(h: &Histogram<u64>, q: f64) -> Option<f64> {
    (!h.is_empty()).then(|| round3(h.value_at_quantile(q) as f64 / 1000.0))
}

#[derive(diesel::QueryableByName)]
struct Epoch {
    #[diesel(sql_type = Double)]
    now: f64,
}

#[derive(diesel::QueryableByName)]
struct Pickup {
    #[diesel(sql_type = BigInt)]
    us: i64,
}

#[derive(diesel::QueryableByName)]
struct Dead {
    #[diesel(sql_type = Text)]
    relname: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// The database's clock, in seconds since the epoch.
async fn db_now(conn: &mut AsyncPgConnection) -> anyhow::Result<f64> {
    let e: Epoch = diesel::sql_query("SELECT extract(epoch FROM clock_timestamp())::float8 AS now")
        .get_result(conn)
        .await?;
    Ok(e.now)
}

/// Sends items at the rate in `rate` (items/s, f64 bits), credited on wall-clock
/// time, round-robin over the tenants; counts them in `sent`.
async fn produce(
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
async fn stress(url: String, cell: Cell, stop: CancellationToken) -> anyhow::Result<()> {
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

/// One sample: what the database says about the window `[from, to)` (its clock).
struct Sample {
    completed: u64,
    pickups: Histogram<u64>,
    backlog: i64,
    dead: BTreeMap<String, i64>,
    index_bytes: i64,
}

async fn sample(conn: &mut AsyncPgConnection, from: f64, to: f64) -> anyhow::Result<Sample> {
    let rows: Vec<Pickup> = diesel::sql_query(
        // Completed by their row (a job with a singleton key) or by a closure
        // (one without): each read by its own index on the time.
        "SELECT (extract(epoch FROM p) * 1e6)::bigint AS us FROM (
             SELECT j.started_at - j.start_after AS p FROM jobs j
              WHERE j.state = 'completed'
                AND j.completed_at >= to_timestamp($1) AND j.completed_at < to_timestamp($2)
             UNION ALL
             SELECT k.claimed_at - j.start_after FROM job_closures z
               JOIN job_claims k ON k.ready_seq = z.ready_seq
               JOIN jobs j ON j.id = z.job_id
              WHERE z.outcome = 'completed'
                AND z.closed_at >= to_timestamp($1) AND z.closed_at < to_timestamp($2)) c",
    )
    .bind::<Double, _>(from)
    .bind::<Double, _>(to)
    .load(conn)
    .await?;
    let mut pickups = histogram();
    for r in &rows {
        pickups.saturating_record(r.us.max(1) as u64);
    }
    let backlog = fixtures::count_rows(
        conn,
        "SELECT count(*) AS n FROM job_states
          WHERE state IN ('created', 'retry') AND start_after <= clock_timestamp()",
    )
    .await?;
    let dead: Vec<Dead> = diesel::sql_query(
        "SELECT relname::text AS relname, n_dead_tup AS n FROM pg_stat_user_tables
          WHERE schemaname = 'public' AND relname <> '__diesel_schema_migrations'",
    )
    .load(conn)
    .await?;
    let index_bytes = fixtures::count_rows(
        conn,
        "SELECT coalesce(sum(pg_relation_size(indexrelid)), 0)::bigint AS n
           FROM pg_stat_user_indexes WHERE schemaname = 'public'",
    )
    .await?;
    Ok(Sample {
        completed: rows.len() as u64,
        pickups,
        backlog,
        dead: dead.into_iter().map(|d| (d.relname, d.n)).collect(),
        index_bytes,
    })
}

/// The workers' peak in units/s: a backlog of `n` units (items with their first
/// jobs, or no-op jobs) sent at once, timed until every job of every unit
/// completed; then emptied again.
async fn peak(
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
    fixtures::vacuum_analyze(conn, &["items", "jobs", "stage_runs", "stage_run_attempts"]).await?;
    Ok(rate)
}

/// The worker processes: `idemstage worker` at its defaults, or the no-op
/// queue's `idemstage pressure-worker`.
fn spawn_workers(
    url: &str,
    workload: Workload,
    n: usize,
    prefetch: usize,
) -> anyhow::Result<Vec<Child>> {
    let exe = std::env::current_exe().context("the idemstage binary")?;
    let prefetch = prefetch.to_string();
    let args: Vec<&str> = match workload {
        Workload::Pipeline => vec!["worker", "--allow-owner", "--prefetch", &prefetch],
        Workload::FanOut => vec![
            "worker",
            "--allow-owner",
            "--fan-out",
            "--prefetch",
            &prefetch,
        ],
        Workload::Queue => vec!["pressure-worker"],
    };
    (0..n)
        .map(|_| {
            Command::new(&exe)
                .args(&args)
                .env("DATABASE_URL", url)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("spawning idemstage worker")
        })
        .collect()
}

/// SIGTERM to every worker; the seconds until the last exited (`None`: one had to
/// be killed after its grace).
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

fn phase_summary(
    h: &Histogram<u64>,
    completed: u64,
    seconds: f64,
    offered: f64,
) -> serde_json::Value {
    json!({
        "completed_per_s": round1(completed as f64 / seconds.max(1e-9)),
        "offered_per_s": round1(offered),
        "pickup_p50_ms": quantile_ms(h, 0.50),
        "pickup_p95_ms": quantile_ms(h, 0.95),
        "pickup_p99_ms": quantile_ms(h, 0.99),
    })
}

pub async fn pressure(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let p = &args.pressure;
    let durations = [p.warmup_s, p.clean_s, p.stress_s, p.recovery_s];
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    fixtures::vacuum_analyze(
        &mut conn,
        &["items", "jobs", "stage_runs", "stage_run_attempts"],
    )
    .await?;
    // Units (items, or queue jobs) per second: the offered jobs/s are this times
    // the jobs per unit.
    let stages = p.workload.jobs_per_unit();
    let tenants: Vec<String> = (0..p.tenants).map(|k| format!("p-{k}")).collect();
    let mut workers = spawn_workers(url, p.workload, p.pressure_workers, p.pressure_prefetch)?;
    let peak_units = match p.workload {
        Workload::Pipeline | Workload::FanOut => p.peak_items,
        Workload::Queue => p.peak_items * 4,
    };
    let peak_items_per_s = match p.items_per_s {
        Some(_) => None,
        None => Some(peak(&mut conn, p.workload, &tenants, peak_units).await?),
    };
    let base = p
        .items_per_s
        .or(peak_items_per_s.map(|r| r / 2.0))
        .unwrap_or(1.0);
    let rate = Arc::new(AtomicU64::new(base.to_bits()));
    let sent = Arc::new(AtomicU64::new(0));
    // No warm-up: the first window is the clean phase's.
    let first_phase = if p.warmup_s > 0.0 { 0 } else { CLEAN };
    let phase = Arc::new(AtomicU8::new(first_phase as u8));

    let stop_producer = CancellationToken::new();
    let producer = tokio::spawn(produce(
        url.to_owned(),
        p.workload,
        tenants,
        rate.clone(),
        sent.clone(),
        stop_producer.clone(),
    ));
    let stop_stress = CancellationToken::new();
    let mut stressor = None;

    let every = Duration::from_secs_f64(p.sample_every_s);
    let started = Instant::now();
    let bounds: Vec<Duration> = durations
        .iter()
        .scan(0.0, |acc, d| {
            *acc += d;
            Some(Duration::from_secs_f64(*acc))
        })
        .collect();
    let mut samples = Vec::new();
    let mut phase_hist: Vec<Histogram<u64>> = (0..PHASES.len()).map(|_| histogram()).collect();
    let mut phase_done = [0_u64; PHASES.len()];
    let mut phase_offered = [0_u64; PHASES.len()];
    let mut window_from = db_now(&mut conn).await?;
    let mut sent_before = 0_u64;
    let mut next_sample = started + every;
    loop {
        tokio::time::sleep_until(next_sample.into()).await;
        next_sample += every;
        let to = db_now(&mut conn).await?;
        let s = sample(&mut conn, window_from, to).await?;
        let seconds = to - window_from;
        window_from = to;
        let k = usize::from(AtomicU8::load(&phase, Ordering::Relaxed));
        let sent_now = AtomicU64::load(&sent, Ordering::Relaxed);
        let offered = (sent_now - sent_before) as f64 * stages;
        sent_before = sent_now;
        phase_hist[k].add(&s.pickups).context("histogram")?;
        phase_done[k] += s.completed;
        phase_offered[k] += offered as u64;
        let dead_total: i64 = s.dead.values().sum();
        samples.push(json!({
            "t_s": round3(started.elapsed().as_secs_f64()),
            "phase": PHASES[k],
            "offered_per_s": round1(offered / seconds),
            "completed_per_s": round1(s.completed as f64 / seconds),
            "pickup_p50_ms": quantile_ms(&s.pickups, 0.50),
            "pickup_p95_ms": quantile_ms(&s.pickups, 0.95),
            "pickup_p99_ms": quantile_ms(&s.pickups, 0.99),
            "backlog": s.backlog,
            "dead_tuples": s.dead.iter().filter(|(_, n)| **n > 0).collect::<BTreeMap<_, _>>(),
            "dead_tuples_total": dead_total,
            "index_bytes_total": s.index_bytes,
        }));
        // Phase changes take effect at sample boundaries, so that every window
        // belongs to exactly one phase.
        let elapsed = started.elapsed() + Duration::from_millis(1);
        let now_phase = bounds.iter().position(|b| elapsed < *b);
        match now_phase {
            Some(n) if n != k => {
                phase.store(n as u8, Ordering::Relaxed);
                if n == STRESS {
                    rate.store((base * p.cell.multiplier()).to_bits(), Ordering::Relaxed);
                    stressor = Some(tokio::spawn(stress(
                        url.to_owned(),
                        p.cell,
                        stop_stress.clone(),
                    )));
                } else if n == RECOVERY {
                    rate.store(base.to_bits(), Ordering::Relaxed);
                    stop_stress.cancel();
                    if let Some(s) = stressor.take() {
                        s.await.context("stress")??;
                    }
                }
            }
            Some(_) => {}
            None => break,
        }
    }
    stop_producer.cancel();
    producer.await.context("producer")??;

    // The backlog drains, then the workers stop within their grace.
    let drain_started = Instant::now();
    let drained = loop {
        let open = fixtures::count_rows(
            &mut conn,
            "SELECT count(*) AS n FROM job_states WHERE state IN ('created', 'retry', 'active')",
        )
        .await?;
        if open == 0 {
            break true;
        }
        if drain_started.elapsed() > DRAIN_GRACE {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let shutdown_s = stop_workers(&mut workers, Duration::from_secs(30))?;

    let mut violations = Vec::new();
    let items = AtomicU64::load(&sent, Ordering::Relaxed);
    let completed = fixtures::count_rows(
        &mut conn,
        "SELECT count(*) AS n FROM job_states WHERE state = 'completed'",
    )
    .await?;
    if drained && completed as u64 != items * stages as u64 {
        violations.push(format!(
            "{completed} jobs completed for {items} units of {stages} jobs"
        ));
    }
    if p.workload == Workload::Pipeline {
        let check = check_example_pipeline(&mut conn).await?;
        violations.extend(check.violations());
        if drained && check.stages_succeeded as u64 != items * stages as u64 {
            violations.push(format!(
                "{} stages succeeded for {items} items of {stages} stages",
                check.stages_succeeded
            ));
        }
    }
    if p.workload == Workload::FanOut {
        let pipeline = example::fan_out_pipeline(Chaos::default(), Default::default())?;
        let check = idemstage_testkit::check_pipeline(&mut conn, &pipeline).await?;
        violations.extend(check.violations());
        if drained && check.stages_succeeded as u64 != items * stages as u64 {
            violations.push(format!(
                "{} stages succeeded for {items} items of {stages} stages (children included)",
                check.stages_succeeded
            ));
        }
    }
    if !drained {
        violations.push(format!(
            "the backlog did not drain within {DRAIN_GRACE:?} after recovery"
        ));
    }
    if shutdown_s.is_none() {
        violations.push("a worker did not stop within its grace after SIGTERM".into());
    }

    let mut summary = serde_json::Map::new();
    for (k, name) in PHASES.iter().enumerate().skip(CLEAN) {
        summary.insert(
            (*name).into(),
            phase_summary(
                &phase_hist[k],
                phase_done[k],
                durations[k],
                phase_offered[k] as f64 / durations[k],
            ),
        );
    }
    let clean_p99 = quantile_ms(&phase_hist[CLEAN], 0.99);
    let stress_p99 = quantile_ms(&phase_hist[STRESS], 0.99);
    let offered_jobs = base * stages;
    let stress_offered = offered_jobs * p.cell.multiplier();
    let stress_rate = phase_done[STRESS] as f64 / durations[STRESS];
    let stress_from = p.warmup_s + p.clean_s;
    let first_240: Vec<f64> = samples
        .iter()
        .filter(|s| {
            s["phase"] == "stress" && s["t_s"].as_f64().unwrap_or(0.0) <= stress_from + 240.0
        })
        .filter_map(|s| s["completed_per_s"].as_f64())
        .collect();
    let clean_backlog = {
        let mut b: Vec<i64> = samples
            .iter()
            .filter(|s| s["phase"] == "clean")
            .filter_map(|s| s["backlog"].as_i64())
            .collect();
        b.sort_unstable();
        b.get(b.len() / 2).copied().unwrap_or(0)
    };
    let recovered_after_s = samples
        .iter()
        .filter(|s| s["phase"] == "recovery")
        .find(|s| {
            s["completed_per_s"].as_f64().unwrap_or(0.0) >= 0.95 * offered_jobs
                && s["backlog"].as_i64().unwrap_or(i64::MAX) <= 2 * clean_backlog.max(1)
        })
        .and_then(|s| s["t_s"].as_f64())
        .map(|t| round1(t - stress_from - p.stress_s));
    let mut dead: Vec<i64> = samples
        .iter()
        .filter(|s| s["phase"] != "warmup")
        .filter_map(|s| s["dead_tuples_total"].as_i64())
        .collect();
    let dead_last = dead.last().copied();
    dead.sort_unstable();
    summary.insert(
        "stress_completion_ratio".into(),
        json!(round3(stress_rate / stress_offered)),
    );
    summary.insert(
        "stress_first_240s_completion_ratio".into(),
        json!((!first_240.is_empty()).then(|| round3(
            first_240.iter().sum::<f64>() / first_240.len() as f64 / stress_offered
        ))),
    );
    summary.insert(
        "stress_p99_ratio".into(),
        json!(clean_p99
            .zip(stress_p99)
            .map(|(c, s)| round3(s / c.max(0.001)))),
    );
    summary.insert("recovered_after_s".into(), json!(recovered_after_s));
    summary.insert("dead_tuples_median".into(), json!(dead.get(dead.len() / 2)));
    summary.insert("dead_tuples_max".into(), json!(dead.last()));
    summary.insert("dead_tuples_last".into(), json!(dead_last));

    let hot_tables: Vec<String> = sample(&mut conn, 0.0, 0.0)
        .await?
        .dead
        .into_keys()
        .collect();
    Ok(json!({
        "scenario": "pressure",
        "system": "idemstage",
        "workload": p.workload.name(),
        "cell": p.cell.name(),
        "workers": p.pressure_workers,
        "tenants": p.tenants,
        "pressure_prefetch": p.pressure_prefetch,
        "items_per_s": round1(base),
        "peak_items_per_s": peak_items_per_s.map(round1),
        "offered_per_s": round1(offered_jobs),
        "stress_offered_per_s": round1(stress_offered),
        "phases": PHASES.iter().zip(durations).filter(|(_, s)| *s > 0.0).map(|(n, s)| json!({"name": n, "s": s})).collect::<Vec<_>>(),
        "sample_every_s": p.sample_every_s,
        "hot_tables": hot_tables,
        "samples": samples,
        "summary": summary,
        "drained": drained,
        "shutdown_s": shutdown_s,
        "violations": violations,
    }))
}
