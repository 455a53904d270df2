//! `idemstage bench fan-out`: one item fanned out into `--children` children
//! (one no-op stage each), then gathered; `--rounds` items one after the
//! other, on one `PipelineWorker` at `--concurrency`. Reported from the
//! database clock: the time from the item's registration to its gather's
//! success, the children's span (fan-out committed → last child final), and
//! the gather's latency after the last child (its claim, and its commit).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use diesel::sql_types::{Double, Nullable, Text};
use diesel::OptionalExtension;
use diesel_async::RunQueryDsl as _;
use idemstage::db::PoolConfig;
use idemstage::prelude::*;
use idemstage::worker::{Counters, PipelineWorkerConfig, QueueWorkerConfig};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::bench::{round1, Args};
use super::fixtures;

const TENANT: &str = "fan";

/// The parent's first stage: hands its input (the number of children) on.
struct Start;

#[async_trait]
impl Stage for Start {
    const NAME: &'static str = "start";
    type Input = String;
    type Prepared = ();
    type Output = u32;
    async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        n: &String,
        _: &(),
    ) -> Result<Done<u32>, StageError> {
        Ok(Done::next(n.trim().parse().unwrap_or(0)))
    }
}

/// The fan-out: one child per number.
struct Spread;

#[async_trait]
impl Stage for Spread {
    const NAME: &'static str = "spread";
    type Input = u32;
    type Prepared = ();
    type Output = Children<u32>;
    async fn prepare(&self, _: &PrepareContext<'_, u32>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        n: &u32,
        _: &(),
    ) -> Result<Done<Children<u32>>, StageError> {
        Ok(Done::next((0..*n).map(|i| (i.to_string(), i)).collect()))
    }
}

/// Per child: nothing but its claim and fenced commit.
struct Work;

#[async_trait]
impl Stage for Work {
    const NAME: &'static str = "work";
    type Input = u32;
    type Prepared = ();
    type Output = u32;
    async fn prepare(&self, _: &PrepareContext<'_, u32>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(&self, _: &mut FencedTx<'_>, i: &u32, _: &()) -> Result<Done<u32>, StageError> {
        Ok(Done::next(*i))
    }
}

/// The gather: the children's sum.
struct Join;

#[async_trait]
impl Stage for Join {
    const NAME: &'static str = "join";
    type Input = Gathered<u32>;
    type Prepared = ();
    type Output = u64;
    async fn prepare(&self, _: &PrepareContext<'_, Gathered<u32>>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        all: &Gathered<u32>,
        _: &(),
    ) -> Result<Done<u64>, StageError> {
        Ok(Done::next(
            all.succeeded().map(|(_, &i)| u64::from(i)).sum(),
        ))
    }
}

#[derive(diesel::QueryableByName)]
struct Round {
    #[diesel(sql_type = Nullable<Double>)]
    total_ms: Option<f64>,
    #[diesel(sql_type = Nullable<Double>)]
    children_ms: Option<f64>,
    #[diesel(sql_type = Nullable<Double>)]
    gather_claim_ms: Option<f64>,
    #[diesel(sql_type = Nullable<Double>)]
    gather_done_ms: Option<f64>,
}

/// One item's times (database clock): registered → gather committed; fan-out
/// committed → last child final; last child final → gather claimed, and →
/// gather committed (its success attempt's end: the start of the transaction
/// that committed it).
const ROUND_SQL: &str = "\
SELECT extract(epoch FROM g.finished_at - a.created_at)::float8 * 1000 AS total_ms,
       extract(epoch FROM f.completed_at - s.finished_at)::float8 * 1000 AS children_ms,
       extract(epoch FROM h.started_at - f.completed_at)::float8 * 1000 AS gather_claim_ms,
       extract(epoch FROM h.finished_at - f.completed_at)::float8 * 1000 AS gather_done_ms
  FROM items a
  JOIN stage_runs s ON s.tenant_id = a.tenant_id AND s.item_id = a.id AND s.stage = 'spread'
  JOIN fanouts f ON f.tenant_id = a.tenant_id AND f.parent_item = a.id
                AND f.stage = 'spread' AND f.attempt = s.success_attempt
  JOIN stage_runs g ON g.tenant_id = a.tenant_id AND g.item_id = a.id AND g.stage = 'join'
  JOIN stage_run_attempts h ON h.run_id = g.id AND h.attempt = g.success_attempt
 WHERE a.tenant_id = $1 AND a.id = $2";

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub async fn fan_out(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    let pipeline = Pipeline::builder(Start)
        .fan_out(Spread)
        .then(Work)
        .gather(Join, GatherPolicy::FailOnDead)
        .build()?;
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
    let worker = PipelineWorker::new(
        pool.clone(),
        url,
        pipeline.clone(),
        config,
        Arc::new(Counters::default()),
    )?;
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(worker.run(shutdown.clone()));
    let tenant = TenantId::parse(TENANT)?;
    let input = args.children.to_string();
    let mut rounds = Vec::new();
    let started = Instant::now();
    for _ in 0..args.rounds {
        let item = ItemId::new();
        idemstage::pipeline::start(&pool, &pipeline, &tenant, &item, &input).await?;
        let deadline = Instant::now() + Duration::from_secs(300);
        let round = loop {
            let round: Option<Round> = diesel::sql_query(ROUND_SQL)
                .bind::<Text, _>(TENANT)
                .bind::<Text, _>(item.to_string())
                .get_result(&mut conn)
                .await
                .optional()?;
            if let Some(round) = round {
                break round;
            }
            anyhow::ensure!(Instant::now() < deadline, "item {item} was not gathered");
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        rounds.push(round);
    }
    let wall_s = started.elapsed().as_secs_f64();
    shutdown.cancel();
    running.await.context("pipeline worker")?;
    // Each child's stage and each gather ran once: one attempt each, success.
    let mut check = Vec::new();
    let works = fixtures::count_rows(
        &mut conn,
        "SELECT count(*) AS n FROM stage_runs WHERE stage = 'work' AND status = 'success' AND attempts = 1",
    )
    .await?;
    if works != i64::from(args.children) * i64::from(args.rounds) {
        check.push(format!(
            "{works} children ran once, not {}",
            args.children * args.rounds
        ));
    }
    let joins = fixtures::count_rows(
        &mut conn,
        "SELECT count(*) AS n FROM stage_runs WHERE stage = 'join' AND status = 'success' AND attempts = 1",
    )
    .await?;
    if joins != i64::from(args.rounds) {
        check.push(format!("{joins} gathers ran once, not {}", args.rounds));
    }
    let series = |f: fn(&Round) -> Option<f64>| {
        let mut v: Vec<f64> = rounds.iter().filter_map(f).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let total = series(|r| r.total_ms);
    let children = series(|r| r.children_ms);
    let claim = series(|r| r.gather_claim_ms);
    let done = series(|r| r.gather_done_ms);
    let per_s: Vec<f64> = children
        .iter()
        .map(|ms| f64::from(args.children) / (ms / 1000.0))
        .collect();
    let mut per_s_sorted = per_s.clone();
    per_s_sorted.sort_by(f64::total_cmp);
    Ok(json!({
        "scenario": "fan-out",
        "children": args.children,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "wall_s": round1(wall_s),
        "item_to_gather_ms": { "p50": round1(quantile(&total, 0.5)), "p99": round1(quantile(&total, 0.99)) },
        "children_span_ms": { "p50": round1(quantile(&children, 0.5)), "p99": round1(quantile(&children, 0.99)) },
        "children_per_s_p50": round1(quantile(&per_s_sorted, 0.5)),
        "gather_claim_after_last_child_ms": { "p50": round1(quantile(&claim, 0.5)), "p99": round1(quantile(&claim, 0.99)) },
        "gather_commit_after_last_child_ms": { "p50": round1(quantile(&done, 0.5)), "p99": round1(quantile(&done, 0.99)) },
        "violations": check,
    }))
}
