//! `idemstage-bench-awa pressure`: the pressure cells of `idemstage bench pressure`
//! (crates/dev/src/pressure.rs; the JSON shape both share is the pressure
//! contract) for a no-op awa queue, worked by `--workers` child processes of this
//! binary (`pressure-worker`).
//!
//! usage: DATABASE_URL=postgres://... idemstage-bench-awa pressure
//!        --cell <clean|idle_in_tx|active_readers|sustained_high_load|event_burst>
//!        --rate <jobs/s> [--clean-s 60] [--stress-s 240] [--recovery-s 120]
//!        [--workers 2] [--sample-every-s 5] [--max-workers 1024]
//!
//! - Workers: each child runs one awa `Client` on the queue with
//!   `QueueConfig { max_workers, .. }` and awa's defaults otherwise (one claimer,
//!   claims of up to `claim_batch_size` 512, completions batched by the runtime,
//!   the default queue storage): the shape of main.rs's `fast` drain, the fastest
//!   its configuration guide documents for a no-op queue (`max_workers` 1,024 is
//!   its 10k/s reference shape). On SIGTERM (or when the parent goes away) a child
//!   calls `Client::shutdown` and exits; the parent times that (`shutdown_s`).
//! - Producer: credited on wall-clock time at the phase's rate; every tick
//!   (50 ms) the jobs due go in one `QueueStorage::enqueue_params_copy` (COPY
//!   straight into queue storage: awa's documented bulk producer path, with the
//!   workers' `QueueStorageConfig`, the default).
//! - Pickup: `attempted_at - run_at` of each job as its handler sees it:
//!   `run_at` is stamped by the producer just before the COPY (the job is
//!   available from then on), `attempted_at` is `clock_timestamp()` in awa's
//!   claim function (same host, same clock). Each child bins its handler calls by
//!   the window they fall in (wall clock from the start of the first phase, sent
//!   over stdin), into one hdrhistogram per window, and reports them on stdout
//!   every 200 ms; the parent merges them and drops a window's histogram once the
//!   window is over (bounded memory). A no-op handler returns at once, so a
//!   handler call is counted as a completion in its window (awa flushes the
//!   durable completion in batches right after).
//! - Backlog: `QueueStorage::queue_counts_fast(..).available`, awa's index-only
//!   depth probe (enqueue minus claim cursors of the queue's lanes).
//! - Dead tuples and index sizes: `HOT_TABLES` of the `awa` schema, each with its
//!   partitions (`pg_partition_tree`) summed into the parent's name.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use awa::{
    Client, InsertOpts, InsertParams, JobArgs, JobResult, QueueConfig, QueueStorage,
    QueueStorageConfig,
};
use hdrhistogram::Histogram;
use serde_json::json;
use sqlx::postgres::{PgConnection, PgPoolOptions};
use sqlx::{Connection, PgPool};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

use crate::{fresh_install, round1, round3, BenchJob};

const USAGE: &str = "usage: DATABASE_URL=postgres://... idemstage-bench-awa pressure \
--cell <clean|idle_in_tx|active_readers|sustained_high_load|event_burst> --rate <jobs/s> \
[--warmup-s 30] [--clean-s 60] [--stress-s 240] [--recovery-s 120] [--workers 2] [--sample-every-s 5] \
[--max-workers 1024]";
const TICK: Duration = Duration::from_millis(50);
const READERS: usize = 4;
const READER_GAP: Duration = Duration::from_millis(100);
const DRAIN_GRACE: Duration = Duration::from_secs(60);
/// `Client::shutdown`'s timeout in a child, and the parent's grace on top of it.
const CLIENT_SHUTDOWN: Duration = Duration::from_secs(30);
const STOP_GRACE: Duration = Duration::from_secs(45);
const REPORT_EVERY: Duration = Duration::from_millis(200);
/// A window's histogram is merged and dropped this long after the window ended
/// (the children report every `REPORT_EVERY`).
const SETTLE: Duration = Duration::from_millis(1500);
/// The warm-up's samples are reported but left out of the summary.
const PHASES: [&str; 4] = ["warmup", "clean", "stress", "recovery"];
const CLEAN: usize = 1;
const STRESS: usize = 2;
const RECOVERY: usize = 3;
/// awa 0.6.9's queue-storage tables (schema `awa`, its migration v023 and later)
/// that a running no-op queue writes (checked on pg_stat_user_tables after a
/// run): per job the ready ring (`ready_entries`, `ready_segments`,
/// `ready_claim_attempt_batches`), the receipts of deadline-backed claims
/// (`lease_claims`) and compact successful completions
/// (`receipt_completion_batches`, `lease_claim_closure_batches`); per rotation
/// or claim round the lane heads (`queue_lanes`, `queue_enqueue_heads`,
/// `queue_claim_heads`, their cursors live in sequences), the rings' rotation
/// cursors (`queue_ring_*`, `lease_ring_*`, `claim_ring_*`), the claimer control
/// plane (`queue_claimer_state`, `queue_claimer_leases`) and
/// `queue_terminal_rollups`. Left out: the tables a no-op success never writes
/// (`done_entries`, `leases`, `attempt_state`, `ready_tombstones`,
/// `lease_claim_batches` of zero-deadline claims, `lease_claim_closures`,
/// `queue_terminal_count_deltas`, `queue_terminal_live_counts`) and the
/// runtime's own bookkeeping (`runtime_instances`, the descriptors).
/// Partitioned tables (the rings' children `<table>_<slot>`) are reported under
/// the parent's name, their partitions' dead tuples and index bytes summed; a
/// table this awa does not have is left out.
const HOT_TABLES: &[&str] = &[
    "ready_entries",
    "ready_segments",
    "ready_claim_attempt_batches",
    "lease_claims",
    "lease_claim_closure_batches",
    "receipt_completion_batches",
    "queue_lanes",
    "queue_enqueue_heads",
    "queue_claim_heads",
    "queue_ring_state",
    "queue_ring_slots",
    "lease_ring_state",
    "lease_ring_slots",
    "claim_ring_state",
    "claim_ring_slots",
    "queue_claimer_state",
    "queue_claimer_leases",
    "queue_terminal_rollups",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cell {
    Clean,
    IdleInTx,
    ActiveReaders,
    SustainedHighLoad,
    EventBurst,
}

impl Cell {
    fn parse(s: &str) -> Option<Cell> {
        Some(match s {
            "clean" => Cell::Clean,
            "idle_in_tx" => Cell::IdleInTx,
            "active_readers" => Cell::ActiveReaders,
            "sustained_high_load" => Cell::SustainedHighLoad,
            "event_burst" => Cell::EventBurst,
            _ => return None,
        })
    }

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

struct Params {
    cell: Cell,
    rate: f64,
    durations: [f64; 4],
    workers: usize,
    sample_every_s: f64,
    max_workers: u32,
}

fn positive(flag: &str, value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{flag} {value:?}: expected a positive number")),
    }
}

fn count(flag: &str, value: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(format!("{flag} {value:?}: expected a positive integer")),
    }
}

fn parse(args: &[String]) -> Result<Params, String> {
    let (mut cell, mut rate) = (None, None);
    let mut durations = [30.0, 60.0, 240.0, 120.0];
    let (mut workers, mut sample_every_s, mut max_workers) = (2, 5.0, 1024);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag}: a value is missing"))?;
        match flag.as_str() {
            "--cell" => {
                cell = Some(
                    Cell::parse(value).ok_or_else(|| format!("--cell {value:?}: unknown cell"))?,
                )
            }
            "--rate" => rate = Some(positive(flag, value)?),
            "--warmup-s" => {
                durations[0] = match value.parse::<f64>() {
                    Ok(v) if v.is_finite() && v >= 0.0 => v,
                    _ => return Err(format!("{flag} {value:?}: expected 0 or more seconds")),
                }
            }
            "--clean-s" => durations[CLEAN] = positive(flag, value)?,
            "--stress-s" => durations[STRESS] = positive(flag, value)?,
            "--recovery-s" => durations[RECOVERY] = positive(flag, value)?,
            "--workers" => workers = count(flag, value)? as usize,
            "--sample-every-s" => sample_every_s = positive(flag, value)?,
            "--max-workers" => {
                max_workers = u32::try_from(count(flag, value)?)
                    .map_err(|_| format!("{flag} {value:?}: too large"))?
            }
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(Params {
        cell: cell.ok_or("--cell is required")?,
        rate: rate.ok_or("--rate is required")?,
        durations,
        workers,
        sample_every_s,
        max_workers,
    })
}

fn bad_input(msg: &str) -> ! {
    eprintln!("idemstage-bench-awa pressure: {msg}\n{USAGE}");
    std::process::exit(2)
}

fn unix_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Pickup latencies in microseconds: up to an hour at 3 significant figures
/// (a few tens of KiB, whatever the rate), as `idemstage bench pressure`.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn quantile_ms(h: &Histogram<u64>, q: f64) -> Option<f64> {
    (!h.is_empty()).then(|| round3(h.value_at_quantile(q) as f64 / 1000.0))
}

/// The handler calls of one window: how many, and their pickup latencies.
struct Window {
    n: u64,
    h: Histogram<u64>,
}

impl Window {
    fn new() -> Window {
        Window {
            n: 0,
            h: histogram(),
        }
    }
}

// ---------------------------------------------------------------- the child

/// `pressure-worker --queue Q --max-workers N --sample-every-s S`: one awa
/// `Client` on Q. Stdout: `READY` once started, `T0OK` once the window origin
/// (`T0 <unix µs>` on stdin) is set, then every 200 ms one JSON line per window
/// with handler calls `{"w": window, "n": calls, "h": [[µs, count], ...]}`, and
/// `BYE` after the shutdown. SIGTERM or the end of stdin shut it down.
pub async fn worker_main(args: &[String]) -> anyhow::Result<()> {
    let mut queue = None;
    let (mut max_workers, mut sample_every_s) = (1024_u32, 5.0_f64);
    let mut it = args.iter();
    while let (Some(flag), Some(value)) = (it.next(), it.next()) {
        match flag.as_str() {
            "--queue" => queue = Some(value.clone()),
            "--max-workers" => max_workers = value.parse().context("--max-workers")?,
            "--sample-every-s" => sample_every_s = value.parse().context("--sample-every-s")?,
            other => bail!("pressure-worker: unknown flag {other:?}"),
        }
    }
    let queue = queue.context("pressure-worker: --queue is required")?;
    let url = std::env::var("DATABASE_URL").context("DATABASE_URL is not set")?;
    let pool = PgPoolOptions::new()
        .max_connections(24)
        .connect(&url)
        .await?;
    let window_us = ((sample_every_s * 1e6) as i64).max(1);
    let origin = Arc::new(AtomicI64::new(0));
    let pending: Arc<Mutex<BTreeMap<i64, Window>>> = Arc::default();
    let unclaimed = Arc::new(AtomicU64::new(0));
    let (h_origin, h_pending, h_unclaimed) = (origin.clone(), pending.clone(), unclaimed.clone());
    let client = Client::builder(pool.clone())
        .queue(
            &queue,
            QueueConfig {
                max_workers,
                ..QueueConfig::default()
            },
        )
        .register::<BenchJob, _, _>(move |_args, ctx| {
            let now = unix_us();
            let t0 = h_origin.load(Ordering::Relaxed);
            let w = if t0 == 0 {
                -1
            } else {
                (now - t0).div_euclid(window_us)
            };
            // The claim's clock_timestamp() (set for deadline-backed claims, the
            // default); else the handler's start.
            let claimed = ctx.job.attempted_at.map_or_else(
                || {
                    h_unclaimed.fetch_add(1, Ordering::Relaxed);
                    now
                },
                |a| a.timestamp_micros(),
            );
            let us = (claimed - ctx.job.run_at.timestamp_micros()).max(1) as u64;
            let mut pending = h_pending.lock().unwrap();
            let win = pending.entry(w).or_insert_with(Window::new);
            win.n += 1;
            win.h.saturating_record(us);
            drop(pending);
            async { Ok(JobResult::Completed) }
        })
        .build()?;
    client.start().await?;
    println!("READY");

    let flush = || {
        let windows = std::mem::take(&mut *pending.lock().unwrap());
        for (w, win) in windows {
            let h: Vec<[u64; 2]> = win
                .h
                .iter_recorded()
                .map(|v| [v.value_iterated_to(), v.count_at_value()])
                .collect();
            println!("{}", json!({"w": w, "n": win.n, "h": h}));
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let mut tick = tokio::time::interval(REPORT_EVERY);
    loop {
        tokio::select! {
            _ = term.recv() => break,
            line = stdin.next_line() => match line? {
                Some(l) => {
                    if let Some(t0) = l.strip_prefix("T0 ") {
                        origin.store(t0.trim().parse().context("T0")?, Ordering::Relaxed);
                        println!("T0OK");
                    }
                }
                None => break,
            },
            _ = tick.tick() => flush(),
        }
    }
    client.shutdown(CLIENT_SHUTDOWN).await;
    flush();
    let unclaimed = unclaimed.load(Ordering::Relaxed);
    if unclaimed > 0 {
        eprintln!("awa pressure-worker: {unclaimed} jobs without attempted_at, pickup taken at the handler");
    }
    println!("BYE");
    // Not through the runtime's drop: it would wait for the blocking stdin read.
    std::process::exit(0)
}

// ---------------------------------------------------------------- the parent

/// What the children reported, by window (index k: `[k, k+1) * sample_every_s`
/// from the start of the first phase; -1: before it).
#[derive(Default)]
struct Reports {
    open: BTreeMap<i64, Window>,
    handled: u64,
}

impl Reports {
    fn merge(&mut self, line: &str) -> anyhow::Result<()> {
        let v: serde_json::Value = serde_json::from_str(line).context("a worker's report")?;
        let w = v["w"].as_i64().context("report: w")?;
        let n = v["n"].as_u64().context("report: n")?;
        let win = self.open.entry(w).or_insert_with(Window::new);
        win.n += n;
        self.handled += n;
        for pair in v["h"].as_array().context("report: h")? {
            let (us, c) = (pair[0].as_u64(), pair[1].as_u64());
            win.h
                .record_n(us.context("report: h")?, c.context("report: h")?)
                .context("report: h")?;
        }
        Ok(())
    }
}

struct Worker {
    child: Child,
    stdin: tokio::process::ChildStdin,
    reader: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// The child processes; their stdout lines: reports into `reports`, the rest
/// (`READY`, `T0OK`, `BYE`, `EOF` at the end) to `control` with the child's index.
fn spawn_workers(
    p: &Params,
    url: &str,
    queue: &str,
    reports: &Arc<Mutex<Reports>>,
    control: &mpsc::UnboundedSender<(usize, String)>,
) -> anyhow::Result<Vec<Worker>> {
    let exe = std::env::current_exe().context("this binary")?;
    (0..p.workers)
        .map(|i| {
            let mut child = Command::new(&exe)
                .arg("pressure-worker")
                .args(["--queue", queue])
                .args(["--max-workers", &p.max_workers.to_string()])
                .args(["--sample-every-s", &p.sample_every_s.to_string()])
                .env("DATABASE_URL", url)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .context("spawning pressure-worker")?;
            let stdin = child.stdin.take().context("worker stdin")?;
            let stdout = child.stdout.take().context("worker stdout")?;
            let (reports, control) = (reports.clone(), control.clone());
            let reader = tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Some(line) = lines.next_line().await? {
                    if line.starts_with('{') {
                        reports.lock().unwrap().merge(&line)?;
                    } else {
                        let _ = control.send((i, line));
                    }
                }
                let _ = control.send((i, "EOF".into()));
                anyhow::Ok(())
            });
            Ok(Worker {
                child,
                stdin,
                reader,
            })
        })
        .collect()
}

/// Waits until every worker said `word`.
async fn await_all(
    control: &mut mpsc::UnboundedReceiver<(usize, String)>,
    workers: usize,
    word: &str,
    within: Duration,
) -> anyhow::Result<()> {
    let mut seen = vec![false; workers];
    let deadline = tokio::time::Instant::now() + within;
    while seen.iter().any(|s| !s) {
        match tokio::time::timeout_at(deadline, control.recv()).await {
            Ok(Some((i, line))) if line == word => seen[i] = true,
            Ok(Some((i, line))) if line == "EOF" => bail!("worker {i} exited before {word}"),
            Ok(Some(_)) => {}
            Ok(None) => bail!("the workers' control channel closed"),
            Err(_) => bail!("the workers did not say {word} within {within:?}"),
        }
    }
    Ok(())
}

/// Sends jobs at the rate in `rate` (jobs/s, f64 bits), credited on wall-clock
/// time: each tick sends what the clock credited since the last one, in one
/// COPY, so a slow tick sends more in the next; counts them in `sent`.
async fn produce(
    pool: PgPool,
    storage: QueueStorage,
    queue: String,
    rate: Arc<AtomicU64>,
    sent: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let mut credit = 0.0_f64;
    let mut last = Instant::now();
    let mut next = 0_u64;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let now = Instant::now();
        credit +=
            now.duration_since(last).as_secs_f64() * f64::from_bits(rate.load(Ordering::Relaxed));
        last = now;
        let n = credit.floor() as u64;
        if n == 0 {
            continue;
        }
        credit -= n as f64;
        let batch: Vec<InsertParams> = (next..next + n)
            .map(|i| InsertParams {
                kind: BenchJob::kind().to_owned(),
                args: json!({ "i": i }),
                opts: InsertOpts {
                    queue: queue.clone(),
                    ..InsertOpts::default()
                },
            })
            .collect();
        storage.enqueue_params_copy(&pool, &batch).await?;
        next += n;
        sent.fetch_add(n, Ordering::Relaxed);
    }
    Ok(())
}

/// The stress connections of a cell, held until `stop` turns true.
async fn stress(
    url: String,
    cell: Cell,
    hot: Vec<String>,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    match cell {
        Cell::IdleInTx => {
            let mut conn = PgConnection::connect(&url).await?;
            sqlx::query("BEGIN").execute(&mut conn).await?;
            let _: i64 = sqlx::query_scalar("SELECT txid_current()")
                .fetch_one(&mut conn)
                .await?;
            stop.wait_for(|s| *s).await?;
            sqlx::query("ROLLBACK").execute(&mut conn).await?;
        }
        Cell::ActiveReaders => {
            let mut readers = tokio::task::JoinSet::new();
            for _ in 0..READERS {
                let (url, hot, mut stop) = (url.clone(), hot.clone(), stop.clone());
                readers.spawn(async move {
                    let mut conn = PgConnection::connect(&url).await?;
                    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
                        .execute(&mut conn)
                        .await?;
                    while !*stop.borrow() {
                        for t in &hot {
                            let _: i64 =
                                sqlx::query_scalar(&format!("SELECT count(*) FROM awa.{t}"))
                                    .fetch_one(&mut conn)
                                    .await?;
                        }
                        tokio::select! {
                            _ = tokio::time::sleep(READER_GAP) => {}
                            _ = stop.wait_for(|s| *s) => {}
                        }
                    }
                    sqlx::query("COMMIT").execute(&mut conn).await?;
                    anyhow::Ok(())
                });
            }
            while let Some(r) = readers.join_next().await {
                r??;
            }
        }
        _ => {
            stop.wait_for(|s| *s).await?;
        }
    }
    Ok(())
}

/// The hot tables this awa has.
async fn hot_tables(pool: &PgPool) -> anyhow::Result<Vec<String>> {
    let names: Vec<String> = HOT_TABLES.iter().map(|t| (*t).to_owned()).collect();
    let present: Vec<String> = sqlx::query_scalar(
        "SELECT t FROM unnest($1::text[]) WITH ORDINALITY AS x(t, k)
          WHERE to_regclass(format('awa.%I', t)) IS NOT NULL ORDER BY k",
    )
    .bind(&names)
    .fetch_all(pool)
    .await?;
    Ok(present)
}

/// What the database says at a sample: the backlog, the dead tuples of each hot
/// table (its partitions summed into it) and the bytes of their indexes.
struct DbSample {
    backlog: i64,
    dead: BTreeMap<String, i64>,
    index_bytes: i64,
}

async fn db_sample(
    pool: &PgPool,
    storage: &QueueStorage,
    queue: &str,
    hot: &[String],
) -> anyhow::Result<DbSample> {
    let backlog = storage.queue_counts_fast(pool, queue).await?.available;
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        // pg_partition_tree() has no rows for a table that is not partitioned:
        // the table itself is added.
        "SELECT t,
                (SELECT coalesce(sum(s.n_dead_tup), 0) FROM pg_stat_user_tables s
                  WHERE s.relid IN (SELECT relid::oid FROM pg_partition_tree(r)
                                    UNION SELECT r::oid))::bigint,
                (SELECT coalesce(sum(pg_relation_size(i.indexrelid)), 0) FROM pg_index i
                  WHERE i.indrelid IN (SELECT relid::oid FROM pg_partition_tree(r)
                                       UNION SELECT r::oid))::bigint
           FROM unnest($1::text[]) AS t,
                LATERAL (SELECT format('awa.%I', t)::regclass AS r) AS x",
    )
    .bind(hot)
    .fetch_all(pool)
    .await?;
    Ok(DbSample {
        backlog,
        index_bytes: rows.iter().map(|r| r.2).sum(),
        dead: rows.into_iter().map(|(t, d, _)| (t, d)).collect(),
    })
}

/// A finished window: its phase, the jobs completed in it and their pickups.
struct WindowStats {
    completed: u64,
    p50: Option<f64>,
    p95: Option<f64>,
    p99: Option<f64>,
}

/// Per phase: the windows' histograms merged, their completions.
struct Phases {
    hist: Vec<Histogram<u64>>,
    done: [u64; PHASES.len()],
    windows: [u64; PHASES.len()],
}

/// Merges the reported windows below `upto` that have a sample into `stats` and
/// `phases`, and drops their histograms (reports that arrive after that add to
/// the window's count and its phase, not its quantiles).
fn settle(
    reports: &Mutex<Reports>,
    upto: i64,
    sample_phase: &[usize],
    stats: &mut BTreeMap<i64, WindowStats>,
    phases: &mut Phases,
) -> anyhow::Result<()> {
    let upto = upto.min(sample_phase.len() as i64);
    let settled: Vec<(i64, Window)> = {
        let mut r = reports.lock().unwrap();
        let keep = r.open.split_off(&upto);
        let done = std::mem::replace(&mut r.open, keep);
        done.into_iter().filter(|(w, _)| *w >= 0).collect()
    };
    for (w, win) in settled {
        let k = sample_phase[w as usize];
        phases.hist[k].add(&win.h).context("histogram")?;
        phases.done[k] += win.n;
        let s = stats.entry(w).or_insert_with(|| WindowStats {
            completed: 0,
            p50: quantile_ms(&win.h, 0.50),
            p95: quantile_ms(&win.h, 0.95),
            p99: quantile_ms(&win.h, 0.99),
        });
        s.completed += win.n;
    }
    Ok(())
}

/// SIGTERM to every worker; the seconds until the last exited (`None`: one had to
/// be killed after `STOP_GRACE`), and whether all exited with success.
async fn stop_workers(workers: &mut [Worker]) -> anyhow::Result<(Option<f64>, bool)> {
    let started = Instant::now();
    for w in workers.iter() {
        if let Some(pid) = w.child.id() {
            Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await
                .context("kill -TERM")?;
        }
    }
    let deadline = tokio::time::Instant::now() + STOP_GRACE;
    let (mut clean, mut success) = (true, true);
    for w in workers.iter_mut() {
        match tokio::time::timeout_at(deadline, w.child.wait()).await {
            Ok(status) => success &= status?.success(),
            Err(_) => {
                w.child.kill().await?;
                clean = false;
            }
        }
    }
    Ok((
        clean.then(|| round3(started.elapsed().as_secs_f64())),
        success,
    ))
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

/// `pressure ...`: prints the run's JSON; exit code 2 on bad flags, 1 on
/// violations.
pub async fn main(args: &[String]) -> anyhow::Result<()> {
    let p = parse(args).unwrap_or_else(|msg| bad_input(&msg));
    let url =
        std::env::var("DATABASE_URL").unwrap_or_else(|_| bad_input("DATABASE_URL is not set"));
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await?;
    // Whatever an earlier run left (the benchmark database is disposable).
    fresh_install(&pool).await?;
    let hot = hot_tables(&pool).await?;
    sqlx::query("VACUUM ANALYZE").execute(&pool).await?;
    let queue = format!("pressure_{}", std::process::id());
    // The workers' queue-storage configuration: awa's default.
    let storage = QueueStorage::new(QueueStorageConfig::default())?;

    let reports: Arc<Mutex<Reports>> = Arc::default();
    let (control_tx, mut control) = mpsc::unbounded_channel();
    let mut workers = spawn_workers(&p, &url, &queue, &reports, &control_tx)?;
    drop(control_tx);
    await_all(&mut control, p.workers, "READY", Duration::from_secs(60)).await?;
    let started = Instant::now();
    let t0 = unix_us();
    for w in &mut workers {
        w.stdin.write_all(format!("T0 {t0}\n").as_bytes()).await?;
        w.stdin.flush().await?;
    }
    await_all(&mut control, p.workers, "T0OK", Duration::from_secs(10)).await?;

    let base = p.rate;
    let rate = Arc::new(AtomicU64::new(base.to_bits()));
    let sent = Arc::new(AtomicU64::new(0));
    let stop_producer = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(
        pool.clone(),
        QueueStorage::new(QueueStorageConfig::default())?,
        queue.clone(),
        rate.clone(),
        sent.clone(),
        stop_producer.clone(),
    ));
    let (stop_stress, stress_stop_rx) = watch::channel(false);
    let mut stressor = None;

    let mut violations: Vec<String> = Vec::new();
    let every = Duration::from_secs_f64(p.sample_every_s);
    let bounds: Vec<Duration> = p
        .durations
        .iter()
        .scan(0.0, |acc, d| {
            *acc += d;
            Some(Duration::from_secs_f64(*acc))
        })
        .collect();
    // Per sample: its JSON so far, its phase; the windows' stats come later.
    let mut samples: Vec<serde_json::Value> = Vec::new();
    let mut sample_phase: Vec<usize> = Vec::new();
    let mut stats: BTreeMap<i64, WindowStats> = BTreeMap::new();
    let mut phases = Phases {
        hist: (0..PHASES.len()).map(|_| histogram()).collect(),
        done: [0; PHASES.len()],
        windows: [0; PHASES.len()],
    };
    let mut phase_offered = [0_u64; PHASES.len()];
    // No warm-up: the first window is the clean phase's.
    let mut phase = if p.durations[0] > 0.0 { 0 } else { CLEAN };
    let mut last_at = started;
    let mut sent_before = 0_u64;
    let mut next_sample = started + every;
    loop {
        tokio::time::sleep_until(next_sample.into()).await;
        next_sample += every;
        let at = Instant::now();
        let seconds = at.duration_since(last_at).as_secs_f64();
        last_at = at;
        let sent_now = sent.load(Ordering::Relaxed);
        let offered = sent_now - sent_before;
        sent_before = sent_now;
        let s = db_sample(&pool, &storage, &queue, &hot).await?;
        phase_offered[phase] += offered;
        phases.windows[phase] += 1;
        sample_phase.push(phase);
        samples.push(json!({
            "t_s": round3(at.duration_since(started).as_secs_f64()),
            "phase": PHASES[phase],
            "offered_per_s": round1(offered as f64 / seconds),
            "backlog": s.backlog,
            "dead_tuples": s.dead,
            "dead_tuples_total": s.dead.values().sum::<i64>(),
            "index_bytes_total": s.index_bytes,
        }));
        let settled_upto = ((at.duration_since(started).saturating_sub(SETTLE)).as_secs_f64()
            / p.sample_every_s)
            .floor() as i64;
        settle(
            &reports,
            settled_upto,
            &sample_phase,
            &mut stats,
            &mut phases,
        )?;
        while let Ok((i, line)) = control.try_recv() {
            if line == "EOF" {
                violations.push(format!("worker {i} exited during the run"));
            }
        }
        // Phase changes take effect at sample boundaries, so that every window
        // belongs to exactly one phase.
        let elapsed = started.elapsed() + Duration::from_millis(1);
        match bounds.iter().position(|b| elapsed < *b) {
            Some(n) if n != phase => {
                phase = n;
                if n == STRESS {
                    rate.store((base * p.cell.multiplier()).to_bits(), Ordering::Relaxed);
                    stressor = Some(tokio::spawn(stress(
                        url.clone(),
                        p.cell,
                        hot.clone(),
                        stress_stop_rx.clone(),
                    )));
                } else if n == RECOVERY {
                    rate.store(base.to_bits(), Ordering::Relaxed);
                    stop_stress.send_replace(true);
                    if let Some(s) = stressor.take() {
                        s.await.context("stress")??;
                    }
                }
            }
            Some(_) => {}
            None => break,
        }
    }
    stop_producer.store(true, Ordering::Relaxed);
    producer.await.context("producer")??;
    let sent_total = sent.load(Ordering::Relaxed);

    // The backlog drains (nothing available, every job sent reached a
    // handler), then the workers stop.
    let drain_started = Instant::now();
    let drained = loop {
        let available = storage.queue_counts_fast(&pool, &queue).await?.available;
        if available == 0 && reports.lock().unwrap().handled >= sent_total {
            break true;
        }
        if drain_started.elapsed() > DRAIN_GRACE {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (shutdown_s, exited_ok) = stop_workers(&mut workers).await?;
    for w in workers {
        w.reader.await.context("worker reader")??;
    }
    while let Ok((i, line)) = control.try_recv() {
        if line != "EOF" && line != "BYE" {
            eprintln!("awa pressure: worker {i} said {line:?}");
        }
    }
    settle(&reports, i64::MAX, &sample_phase, &mut stats, &mut phases)?;
    let handled = reports.lock().unwrap().handled;

    if !drained {
        violations.push(format!(
            "the backlog did not drain within {DRAIN_GRACE:?} after recovery"
        ));
    }
    if shutdown_s.is_none() {
        violations.push(format!(
            "a worker did not stop within {STOP_GRACE:?} after SIGTERM"
        ));
    }
    if !exited_ok {
        violations.push("a worker exited with a failure".into());
    }
    if handled < sent_total {
        violations.push(format!(
            "{} of {sent_total} jobs sent never reached a handler",
            sent_total - handled
        ));
    } else if handled > sent_total {
        violations.push(format!(
            "{handled} handler calls for {sent_total} jobs sent"
        ));
    }

    // The samples' completions and pickups.
    let window_s = p.sample_every_s;
    for (w, s) in samples.iter_mut().enumerate() {
        let st = stats.get(&(w as i64));
        s["completed_per_s"] = json!(round1(st.map_or(0, |x| x.completed) as f64 / window_s));
        s["pickup_p50_ms"] = json!(st.and_then(|x| x.p50));
        s["pickup_p95_ms"] = json!(st.and_then(|x| x.p95));
        s["pickup_p99_ms"] = json!(st.and_then(|x| x.p99));
    }

    let mut summary = serde_json::Map::new();
    for (k, name) in PHASES.iter().enumerate().skip(CLEAN) {
        let seconds = phases.windows[k] as f64 * window_s;
        summary.insert(
            (*name).into(),
            phase_summary(
                &phases.hist[k],
                phases.done[k],
                seconds,
                phase_offered[k] as f64 / seconds.max(1e-9),
            ),
        );
    }
    let clean_p99 = quantile_ms(&phases.hist[CLEAN], 0.99);
    let stress_p99 = quantile_ms(&phases.hist[STRESS], 0.99);
    let stress_offered = base * p.cell.multiplier();
    let stress_rate =
        phases.done[STRESS] as f64 / (phases.windows[STRESS] as f64 * window_s).max(1e-9);
    let (stress_from, stress_s) = (p.durations[0] + p.durations[CLEAN], p.durations[STRESS]);
    let first_240: Vec<f64> = samples
        .iter()
        .filter(|s| {
            s["phase"] == "stress" && s["t_s"].as_f64().unwrap_or(0.0) <= stress_from + 240.0 + 0.5
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
            s["completed_per_s"].as_f64().unwrap_or(0.0) >= 0.95 * base
                && s["backlog"].as_i64().unwrap_or(i64::MAX) <= 2 * clean_backlog.max(1)
        })
        .and_then(|s| s["t_s"].as_f64())
        .map(|t| round1(t - stress_from - stress_s));
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

    let report = json!({
        "scenario": "pressure",
        "system": "awa",
        "workload": "queue",
        "version": env!("AWA_VERSION"),
        "worker_config": format!(
            "Client max_workers {}, claim_batch_size 512, 1 claimer, default queue storage; producer QueueStorage::enqueue_params_copy",
            p.max_workers
        ),
        "cell": p.cell.name(),
        "workers": p.workers,
        "offered_per_s": round1(base),
        "stress_offered_per_s": round1(stress_offered),
        "phases": PHASES.iter().zip(p.durations).filter(|(_, s)| *s > 0.0).map(|(n, s)| json!({"name": n, "s": s})).collect::<Vec<_>>(),
        "sample_every_s": p.sample_every_s,
        "hot_tables": hot,
        "samples": samples,
        "summary": summary,
        "drained": drained,
        "shutdown_s": shutdown_s,
        "violations": violations,
    });
    println!("{}", serde_json::to_string(&report)?);
    if !violations.is_empty() {
        eprintln!("awa pressure: {}", violations.join("; "));
        std::process::exit(1);
    }
    Ok(())
}
