//! `idemstage demo`: the main job. Many duplicate sends from concurrent tasks, many
//! worker pools, injected crashes; then the database is checked after the fact and
//! a report printed.

use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fixtures;
use anyhow::Context;
use diesel_async::AsyncConnection;
use idemstage::items::register_item;
use idemstage::pipeline::first_job;
use idemstage::{db::PoolConfig, runs::TxError};
use idemstage::{ids::ItemId, ids::TenantId, queue::SendResult};
use idemstage::{worker::Counters, worker::PipelineWorker, worker::PipelineWorkerConfig};
use idemstage_example::check_example_pipeline;
use idemstage_example::{self as example, Chaos};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::task::JoinSet;

use super::BadInput;

#[derive(clap::Args)]
pub struct Args {
    /// Number of items
    #[arg(long, default_value_t = 500)]
    items: usize,
    /// Number of tenants the items are spread over
    #[arg(long, default_value_t = 4)]
    tenants: usize,
    /// How often each item is sent, from concurrent tasks
    #[arg(long, default_value_t = 3)]
    duplicates: usize,
    /// Worker pools (each with its own connection pool and worker id)
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Concurrent stage executions per worker pool
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Probability that a stage body aborts mid-way after part of its writes
    #[arg(long, default_value_t = 0.05)]
    crash_rate: f64,
    /// The local "LLM" service: how long it thinks before each answer (ms)
    #[arg(long, default_value_t = 0)]
    llm_latency_ms: u64,
    /// The local "LLM" service answers every Nth request 429 with Retry-After (1 s)
    #[arg(long, value_name = "N")]
    llm_429_every: Option<u32>,
    /// The local "LLM" service answers this share of requests 500 (0 to below 1)
    #[arg(long, default_value_t = 0.0)]
    llm_failure_rate: f64,
    /// Give up (and fail) after this many seconds
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Seed of the generated texts and send order
    #[arg(long)]
    seed: Option<u64>,
    /// Print the report as one JSON object on the last line
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    items: i64,
    tenants: usize,
    sends: usize,
    stages_succeeded: i64,
    /// Calls the "LLM" answered (paid), and the extractions that succeeded.
    llm_calls: u64,
    /// Every request the "LLM" got, refused (429) and failed (500) ones too.
    llm_requests: u64,
    extractions: i64,
    duplicates_refused: u64,
    claim_skips: u64,
    retries: i64,
    fenced: i64,
    double_executions: i64,
    lost_stages: i64,
    items_final: i64,
    feasible: i64,
    infeasible: i64,
    foreign_writes: i64,
    runs_by_status: std::collections::BTreeMap<String, i64>,
    wall_s: f64,
    stages_per_s: f64,
    violations: Vec<String>,
}

/// A text per item: mostly priceable positions; every 10th has a problem that
/// makes it infeasible (a unit without a price, a line without a quantity).
fn generate_text(rng: &mut impl Rng, i: usize) -> String {
    const ITEMS: &[(&str, &str)] = &[
        ("Stk", "Schrauben M8"),
        ("m", "Kabel NYM 3x1,5"),
        ("m2", "Fliesen 30x60"),
        ("kg", "Fugenmörtel"),
        ("h", "Montage"),
        ("l", "Tiefengrund"),
        ("psch", "Baustelleneinrichtung"),
    ];
    let mut lines: Vec<String> = (0..rng.random_range(1..=6))
        .map(|_| {
            let (unit, what) = ITEMS[rng.random_range(0..ITEMS.len())];
            format!("{} {unit} {what}", rng.random_range(1..=40))
        })
        .collect();
    if i % 10 == 9 {
        lines.push(if rng.random() {
            "3 Fass Altöl".to_owned()
        } else {
            "Entsorgung nach Aufwand".to_owned()
        });
    }
    lines.join("\n")
}

pub async fn run(url: &str, args: Args) -> anyhow::Result<ExitCode> {
    if args.items == 0 || args.tenants == 0 || args.duplicates == 0 || args.workers == 0 {
        return Err(BadInput(
            "--items, --tenants, --duplicates and --workers must be positive".into(),
        )
        .into());
    }
    if !(0.0..1.0).contains(&args.crash_rate) {
        return Err(BadInput("--crash-rate must be in [0, 1)".into()).into());
    }
    if !(0.0..1.0).contains(&args.llm_failure_rate) {
        return Err(BadInput("--llm-failure-rate must be in [0, 1)".into()).into());
    }
    if args.llm_429_every == Some(0) {
        return Err(BadInput("--llm-429-every must be at least 1".into()).into());
    }
    idemstage::db::migrate_with(url, vec![idemstage_example::MIGRATIONS]).await?;
    // The verdict is read from the whole database, so it must hold only this run's
    // rows: a demo database (`*_demo`) is emptied first (a second `cargo xtask
    // demo` on a cluster left running), any other one must be empty already.
    {
        let mut conn = idemstage::db::connect(url).await?;
        let stale = check_example_pipeline(&mut conn).await?.items;
        if stale > 0 {
            let db = fixtures::current_database(&mut conn).await?;
            if !(db == "demo" || db.ends_with("_demo")) {
                return Err(BadInput(format!(
                    "database {db:?} already holds {stale} items: the demo checks every \
                     row, so it needs an empty database, or one whose name ends in \"_demo\" \
                     (it empties that one; cargo xtask demo uses idemstage_demo)"
                ))
                .into());
            }
            fixtures::reset(&mut conn).await?;
        }
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let tenants: Vec<TenantId> = (0..args.tenants)
        .map(|i| TenantId::parse(&format!("tenant-{i}")))
        .collect::<Result<_, _>>()?;
    let items: Vec<(TenantId, ItemId, String)> = (0..args.items)
        .map(|i| {
            (
                tenants[i % tenants.len()].clone(),
                ItemId::new(),
                generate_text(&mut rng, i),
            )
        })
        .collect();
    let mut sends: Vec<usize> = (0..args.items)
        .flat_map(|i| std::iter::repeat_n(i, args.duplicates))
        .collect();
    sends.shuffle(&mut rng);
    if !args.json {
        eprintln!(
            "demo: {} items over {} tenants, each sent {}x; {} worker pools x {}; crash rate {}; seed {seed}",
            args.items, args.tenants, args.duplicates, args.workers, args.concurrency, args.crash_rate
        );
    }

    let started = Instant::now();
    let counters = Arc::new(Counters::tracking_successes());
    // The extract stage's "LLM": a local service (loopback, an ephemeral port)
    // that counts the calls it answered, i.e. the calls paid.
    let mut llm_config = example::llm::LlmConfig::default()
        .with_latency(Duration::from_millis(args.llm_latency_ms))
        .with_failure_rate(args.llm_failure_rate)
        .with_seed(seed);
    if let Some(n) = args.llm_429_every {
        llm_config = llm_config.with_rate_limited_every(n);
    }
    let llm =
        example::llm::LlmServer::start(llm_config).context("starting the local LLM service")?;
    let pipeline = example::pipeline_with_llm(
        Chaos::crashing(args.crash_rate),
        idemstage::stage::StagePolicy::default(),
        Some(example::llm::LlmClient::new(llm.url())),
    )?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut workers = JoinSet::new();
    for _ in 0..args.workers {
        let pool = idemstage::db::connect_pool(
            url,
            PoolConfig::default().with_max_size(args.concurrency as u32 * 2 + 2),
        )
        .await?;
        let config = PipelineWorkerConfig::default().with_concurrency(args.concurrency);
        let worker = PipelineWorker::new(pool, url, pipeline.clone(), config, counters.clone())?;
        let token = shutdown.clone();
        workers.spawn(async move { worker.run(token).await });
    }

    // Duplicate sends from 16 concurrent tasks, each item `duplicates` times.
    let items = Arc::new(items);
    let sends = Arc::new(sends);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let refused = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut senders = JoinSet::new();
    for _ in 0..16 {
        let (items, sends, next, refused, pipeline, url) = (
            items.clone(),
            sends.clone(),
            next.clone(),
            refused.clone(),
            pipeline.clone(),
            url.to_owned(),
        );
        senders.spawn(async move {
            let mut conn = idemstage::db::connect(&url).await?;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&a) = sends.get(i) else {
                    return anyhow::Ok(());
                };
                let (tenant, item, text) = &items[a];
                let job = first_job(
                    &pipeline,
                    tenant.clone(),
                    *item,
                    idemstage::ids::input_hash_of(text.as_bytes()),
                );
                let sent = conn
                    .transaction::<_, TxError, _>(async |conn| {
                        register_item(conn, tenant, item, text).await?;
                        Ok(idemstage::queue::send_in(conn, &job).await?)
                    })
                    .await
                    .map_err(TxError::into_repo)?;
                if sent == SendResult::Duplicate {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    while let Some(r) = senders.join_next().await {
        r.context("sender task")??;
    }

    // Wait until the database says every item is final and the queue is idle.
    let progress = if args.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(args.items as u64)
    };
    progress.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} items final {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let mut conn = idemstage::db::connect(url).await?;
    let deadline = started + Duration::from_secs(args.timeout_s);
    let finished = loop {
        let check = check_example_pipeline(&mut conn).await?;
        let live = idemstage::queue::queue_stats(&mut conn).await?.live();
        progress.set_position(check.items_final as u64);
        progress.set_message(format!(
            "({} stage runs succeeded, {live} jobs live)",
            check.stages_succeeded
        ));
        if check.items_final as usize == args.items && live == 0 {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let wall = started.elapsed().as_secs_f64();
    progress.finish();
    shutdown.cancel();
    while let Some(r) = workers.join_next().await {
        r.context("worker task")?;
    }
    // Read again after the workers stopped: nothing may have changed the verdict.
    let check = check_example_pipeline(&mut conn).await?;
    let mut violations = check.violations();
    if !finished {
        violations.push(format!("timed out after {} s", args.timeout_s));
    }
    // Every extraction that succeeded paid one call; a crash after the call reused
    // its answer instead of paying again.
    let llm_calls = llm.calls();
    let extractions = extractions_succeeded(&mut conn).await?;
    if llm_calls != extractions as u64 {
        violations.push(format!(
            "{llm_calls} LLM calls paid for {extractions} successful extractions"
        ));
    }
    let in_memory_doubles = counters.double_successes();
    if in_memory_doubles > 0 {
        violations.push(format!(
            "{in_memory_doubles} keys reported Succeeded twice by workers"
        ));
    }
    let report = Report {
        items: check.items,
        tenants: args.tenants,
        sends: sends.len(),
        stages_succeeded: check.stages_succeeded,
        llm_calls,
        llm_requests: llm.requests(),
        extractions,
        duplicates_refused: refused.load(Ordering::Relaxed),
        claim_skips: counters.skipped.load(Ordering::Relaxed),
        retries: check.retries,
        fenced: check.fenced,
        double_executions: check.double_executions + in_memory_doubles as i64,
        lost_stages: check.lost_stages,
        items_final: check.items_final,
        feasible: check.feasible,
        infeasible: check.infeasible,
        foreign_writes: check.foreign_writes,
        runs_by_status: check.runs_by_status.clone(),
        wall_s: (wall * 1000.0).round() / 1000.0,
        stages_per_s: ((check.stages_succeeded as f64 / wall) * 10.0).round() / 10.0,
        violations,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(if report.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn print_report(r: &Report) {
    println!("idemstage demo report");
    println!(
        "  items                  {:>8}  ({} final, {} feasible, {} infeasible)",
        r.items, r.items_final, r.feasible, r.infeasible
    );
    println!(
        "  sends                     {:>8}  over {} tenants",
        r.sends, r.tenants
    );
    println!("  duplicates refused (queue){:>8}", r.duplicates_refused);
    println!("  skips at the claim        {:>8}", r.claim_skips);
    println!(
        "  stage runs by status      {}",
        r.runs_by_status
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!("  stages succeeded          {:>8}", r.stages_succeeded);
    println!(
        "  LLM calls paid            {:>8}  for {} successful extractions ({} requests)",
        r.llm_calls, r.extractions, r.llm_requests
    );
    println!("  retries                   {:>8}", r.retries);
    println!("  fenced writes             {:>8}", r.fenced);
    println!(
        "  double executions         {:>8}  (must be 0)",
        r.double_executions
    );
    println!(
        "  lost stages               {:>8}  (must be 0)",
        r.lost_stages
    );
    println!("  wall time                 {:>8.2} s", r.wall_s);
    println!("  stages/s                  {:>8.1}", r.stages_per_s);
    if r.violations.is_empty() {
        println!("  verdict: every invariant holds");
    } else {
        println!("  verdict: BROKEN: {}", r.violations.join("; "));
    }
}

/// Extract stages that succeeded (each paid one "LLM" call).
async fn extractions_succeeded(conn: &mut diesel_async::AsyncPgConnection) -> anyhow::Result<i64> {
    use diesel::ExpressionMethods;
    use diesel::QueryDsl;
    use diesel_async::RunQueryDsl;
    use idemstage::schema::stage_runs::dsl as r;
    Ok(r::stage_runs
        .filter(r::stage.eq("extract"))
        .filter(r::status.eq("success"))
        .count()
        .get_result(conn)
        .await?)
}
