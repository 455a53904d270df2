//! `idemstage bench bulk`: a bulk rerun of the last stage for `--items` items of
//! one tenant while another tenant keeps sending. The first tenant's items run
//! through the example pipeline first; then a `PipelineWorker` at
//! `--concurrency` works on while the other tenant sends an item every
//! `--bulk-gap-ms`: `--quiet-s` seconds before the rerun (the baseline), then
//! through the bulk action (`ops::start_bulk` + `ops::run_bulk`, batches of
//! `--bulk-batch`) until every rerun has run. Reported: the bulk command's
//! time, the time until the reruns had run, and the other tenant's items per
//! second and latency (registered → its last stage's success, database clock)
//! before and during.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use diesel::sql_types::{Double, Nullable, Text, Timestamptz};
use diesel_async::AsyncConnection;
use diesel_async::RunQueryDsl as _;
use idemstage::db::PoolConfig;
use idemstage::ops::{self, Actor, BulkAction, BulkFilter};
use idemstage::pipeline::first_job;
use idemstage::queue;
use idemstage::runs::TxError;
use idemstage::worker::{Counters, PipelineWorker, PipelineWorkerConfig, QueueWorkerConfig};
use idemstage::{ids::ItemId, ids::StageName, ids::TenantId};
use idemstage_example::{self as example, check_example_pipeline, Chaos};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::bench::{round1, round3, Args};
use super::fixtures;

const BULK_TENANT: &str = "bulk";
const OTHER_TENANT: &str = "other";
const INPUT: &str = "10 Stk Schrauben M8\n2,5 m Kabel NYM 3x1,5\n4 h Montage";
const LAST_STAGE: &str = "calculate";

#[derive(diesel::QueryableByName)]
struct Latency {
    #[diesel(sql_type = Double)]
    n: f64,
    #[diesel(sql_type = Nullable<Double>)]
    p50_ms: Option<f64>,
    #[diesel(sql_type = Nullable<Double>)]
    p99_ms: Option<f64>,
}

/// The other tenant's items registered in `[from, to)` and done: how many, and
/// their latency to the last stage's success.
async fn other_items(
    conn: &mut diesel_async::AsyncPgConnection,
    from: chrono::DateTime<chrono::Utc>,
    to: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<Latency> {
    Ok(diesel::sql_query(
        "SELECT count(*)::float8 AS n,
                percentile_disc(0.5) WITHIN GROUP (ORDER BY ms) AS p50_ms,
                percentile_disc(0.99) WITHIN GROUP (ORDER BY ms) AS p99_ms
           FROM (SELECT (extract(epoch FROM r.finished_at - a.created_at) * 1000)::float8 AS ms
                   FROM items a JOIN stage_runs r
                     ON r.tenant_id = a.tenant_id AND r.item_id = a.id AND r.stage = $1
                  WHERE a.tenant_id = $2 AND a.created_at >= $3 AND a.created_at < $4
                    AND r.status = 'success') s",
    )
    .bind::<Text, _>(LAST_STAGE)
    .bind::<Text, _>(OTHER_TENANT)
    .bind::<Timestamptz, _>(from)
    .bind::<Timestamptz, _>(to)
    .get_result(conn)
    .await?)
}

async fn db_now(
    conn: &mut diesel_async::AsyncPgConnection,
) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    #[derive(diesel::QueryableByName)]
    struct Now {
        #[diesel(sql_type = Timestamptz)]
        now: chrono::DateTime<chrono::Utc>,
    }
    let row: Now = diesel::sql_query("SELECT clock_timestamp() AS now")
        .get_result(conn)
        .await?;
    Ok(row.now)
}

pub async fn bulk(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    let pipeline = example::pipeline(Chaos::default());
    super::bench::seed_items(&mut conn, &pipeline, BULK_TENANT, args.items, INPUT).await?;
    let tenant = TenantId::parse(BULK_TENANT)?;

    let counters = Arc::new(Counters::default());
    let config = PipelineWorkerConfig::default()
        .with_concurrency(args.concurrency)
        .with_queue(
            QueueWorkerConfig::default()
                .with_batch_size(32)
                .with_prefetch(64),
        );
    let pool =
        idemstage::db::connect_pool(url, PoolConfig::default().with_max_size(config.pool_size()))
            .await?;
    let worker = PipelineWorker::new(pool, url, pipeline.clone(), config, counters.clone())?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    let stages = pipeline.stages().len() as u64;
    let first = args.items * stages;
    let deadline = Instant::now() + Duration::from_secs(1200);
    while std::sync::atomic::AtomicU64::load(&counters.succeeded, Ordering::Relaxed) < first {
        anyhow::ensure!(Instant::now() < deadline, "the first run did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The other tenant sends from now on.
    let stop_sending = CancellationToken::new();
    let sender = {
        let (url, pipeline, stop) = (url.to_owned(), pipeline.clone(), stop_sending.clone());
        let gap = Duration::from_millis(args.bulk_gap_ms);
        tokio::spawn(async move {
            let mut conn = idemstage::db::connect(&url).await?;
            let other = TenantId::parse(OTHER_TENANT)?;
            let hash = idemstage::ids::input_hash_of(INPUT.as_bytes());
            let mut next = tokio::time::Instant::now();
            let mut sent = 0u64;
            while !stop.is_cancelled() {
                let item = ItemId::new();
                let job = first_job(&pipeline, other.clone(), item, hash.clone());
                conn.transaction::<_, TxError, _>(async |conn| {
                    idemstage::items::register_item(conn, &other, &item, INPUT).await?;
                    Ok(queue::send_in(conn, &job).await?)
                })
                .await
                .map_err(TxError::into_repo)?;
                sent += 1;
                next += gap;
                tokio::time::sleep_until(next).await;
            }
            anyhow::Ok(sent)
        })
    };
    let baseline_from = db_now(&mut conn).await?;
    tokio::time::sleep(Duration::from_secs_f64(args.quiet_s)).await;
    let during_from = db_now(&mut conn).await?;

    // The bulk rerun, on a connection of its own.
    let filter = BulkFilter {
        tenant: Some(tenant.clone()),
        stage: Some(StageName::parse(LAST_STAGE)?),
        ..Default::default()
    };
    let actor = Actor::parse("bench")?;
    let started = Instant::now();
    let progress = ops::start_bulk(
        &mut conn,
        BulkAction::Rerun,
        &filter,
        &actor,
        args.bulk_batch,
    )
    .await?;
    let done = ops::run_bulk(&mut conn, &progress.id, &actor, &pipeline, |_| {}).await?;
    let command_s = started.elapsed().as_secs_f64();
    while fixtures::count_rows(
        &mut conn,
        "SELECT count(*) AS n FROM stage_runs r JOIN stage_reruns x ON x.run_id = r.id \
          WHERE r.status = 'success'",
    )
    .await?
        < args.items as i64
    {
        anyhow::ensure!(
            Instant::now() < deadline + Duration::from_secs(600),
            "the reruns did not finish"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reruns_s = started.elapsed().as_secs_f64();
    let during_to = db_now(&mut conn).await?;
    stop_sending.cancel();
    let sent = sender.await.context("sender")??;
    // Wait for the other tenant's last items, then stop.
    let drain = Instant::now() + Duration::from_secs(120);
    while fixtures::count_rows(
        &mut conn,
        "SELECT count(*) AS n FROM job_states WHERE state IN ('created', 'retry', 'active')",
    )
    .await?
        > 0
    {
        anyhow::ensure!(Instant::now() < drain, "the queue did not drain");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.context("pipeline worker")?;

    let before = other_items(&mut conn, baseline_from, during_from).await?;
    let during = other_items(&mut conn, during_from, during_to).await?;
    let before_s = (during_from - baseline_from).as_seconds_f64();
    let during_s = (during_to - during_from).as_seconds_f64();
    let check = check_example_pipeline(&mut conn).await?;
    let mut violations = check.violations();
    if done.acted as u64 != args.items {
        violations.push(format!("{} of {} items rerun", done.acted, args.items));
    }
    Ok(json!({
        "scenario": "bulk",
        "items": args.items,
        "concurrency": args.concurrency,
        "batch_size": args.bulk_batch,
        "rerun_stage": LAST_STAGE,
        "bulk_command_s": round3(command_s),
        "bulk_items_per_s": round1(args.items as f64 / command_s),
        "reruns_done_s": round3(reruns_s),
        "other_sent": sent,
        "other_gap_ms": args.bulk_gap_ms,
        "other_before": {
            "seconds": round1(before_s),
            "items_done_per_s": round1(before.n / before_s),
            "latency_p50_ms": before.p50_ms.map(round1),
            "latency_p99_ms": before.p99_ms.map(round1),
        },
        "other_during": {
            "seconds": round1(during_s),
            "items_done_per_s": round1(during.n / during_s),
            "latency_p50_ms": during.p50_ms.map(round1),
            "latency_p99_ms": during.p99_ms.map(round1),
        },
        "violations": violations,
    }))
}
