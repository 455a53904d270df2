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

mod args;
mod load;
mod sample;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use idemstage_example::{self as example, check_example_pipeline, Chaos};
use serde_json::json;
use tokio_util::sync::CancellationToken;

pub use args::PressureArgs;
pub use load::queue_worker;

use super::bench::{round1, round3, Args};
use super::{bench, fixtures, BadInput};
use args::Workload;
use load::{peak, produce, spawn_workers, stress};
use sample::{db_now, histogram, quantile_ms, sample, summarize, PhaseTotals};

const DRAIN_GRACE: Duration = Duration::from_secs(60);
/// The warm-up's samples are reported but left out of the summary (the method's
/// `warmup` phase: start-up artefacts such as the first plans on fresh tables).
const PHASES: [&str; 4] = ["warmup", "clean", "stress", "recovery"];
const CLEAN: usize = 1;
const STRESS: usize = 2;
const RECOVERY: usize = 3;

pub async fn pressure(url: &str, args: &Args) -> anyhow::Result<serde_json::Value> {
    let p = &args.pressure;
    let durations = [p.warmup_s, p.clean_s, p.stress_s, p.recovery_s];
    let mut conn = idemstage::db::connect(url).await?;
    fixtures::reset(&mut conn).await?;
    fixtures::vacuum_analyze(
        &mut conn,
        &["items", "jobs", "stage_runs", "stage_attempt_ends"],
    )
    .await?;
    // Units (items, or queue jobs) per second: the offered jobs/s are this times
    // the jobs per unit.
    let stages = p.workload.jobs_per_unit();
    let tenants: Vec<String> = (0..p.tenants).map(|k| format!("p-{k}")).collect();
    let mut workers = spawn_workers(
        url,
        p.workload,
        p.pressure_workers,
        p.pressure_prefetch,
        p.pressure_retention_s,
    )?;
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
    let mut totals = PhaseTotals {
        hist: (0..PHASES.len()).map(|_| histogram()).collect(),
        done: [0; PHASES.len()],
        offered: [0; PHASES.len()],
    };
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
        totals.hist[k].add(&s.pickups).context("histogram")?;
        totals.done[k] += s.completed;
        totals.offered[k] += offered as u64;
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
            "autovacuums": s.autovacuums,
            "vacuums_running": s.vacuums_running,
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
    let shutdown_s = workers.stop(Duration::from_secs(30))?;

    let mut violations = Vec::new();
    let items = AtomicU64::load(&sent, Ordering::Relaxed);
    let completed = fixtures::count_rows(
        &mut conn,
        "SELECT count(*) AS n FROM job_states WHERE state = 'completed'",
    )
    .await?;
    // With a short retention the workers have deleted most completed jobs:
    // then the drain (nothing open) is the check, not the count.
    if drained && p.pressure_retention_s.is_none() && completed as u64 != items * stages as u64 {
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

    let offered_jobs = base * stages;
    let stress_offered = offered_jobs * p.cell.multiplier();
    let summary = summarize(&samples, &totals, durations, offered_jobs, stress_offered);

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
        "pressure_retention_s": p.pressure_retention_s,
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
