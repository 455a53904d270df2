//! What a cell measures: a sample of the database every `--sample-every-s`
//! (completions and their pickup latencies, the backlog, dead tuples, the
//! autovacuums so far and those running, and index sizes) and the summary of a
//! run's samples.

use std::collections::BTreeMap;

use diesel::sql_types::{BigInt, Double, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use hdrhistogram::Histogram;
use serde_json::json;

use super::bench::{round1, round3};
use super::fixtures;
use super::{CLEAN, PHASES, STRESS};

/// One window's pickup latencies, in microseconds.
pub(super) fn histogram() -> Histogram<u64> {
    // Up to an hour at 3 significant figures: a few tens of KiB, whatever the rate.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

pub(super) fn quantile_ms(h: &Histogram<u64>, q: f64) -> Option<f64> {
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
    #[diesel(sql_type = BigInt)]
    autovacuums: i64,
}

#[derive(diesel::QueryableByName)]
struct Vacuum {
    #[diesel(sql_type = Text)]
    relname: String,
    #[diesel(sql_type = Text)]
    phase: String,
    #[diesel(sql_type = Double)]
    running_s: f64,
}

/// The database's clock, in seconds since the epoch.
pub(super) async fn db_now(conn: &mut AsyncPgConnection) -> anyhow::Result<f64> {
    let e: Epoch = diesel::sql_query("SELECT extract(epoch FROM clock_timestamp())::float8 AS now")
        .get_result(conn)
        .await?;
    Ok(e.now)
}

/// One sample: what the database says about the window `[from, to)` (its clock).
pub(super) struct Sample {
    pub(super) completed: u64,
    pub(super) pickups: Histogram<u64>,
    pub(super) backlog: i64,
    pub(super) dead: BTreeMap<String, i64>,
    /// Autovacuums of each table since the statistics began (cumulative), so
    /// that a table's visits per window show whether vacuum keeps up with it.
    pub(super) autovacuums: BTreeMap<String, i64>,
    /// The vacuums running in this database at the sample: table, phase and
    /// seconds since their transaction began (a long one holds a worker).
    pub(super) vacuums_running: Vec<serde_json::Value>,
    pub(super) index_bytes: i64,
}

pub(super) async fn sample(
    conn: &mut AsyncPgConnection,
    from: f64,
    to: f64,
) -> anyhow::Result<Sample> {
    let rows: Vec<Pickup> = diesel::sql_query(
        // Every job is completed by a closure, read by its index on the time.
        "SELECT (extract(epoch FROM k.claimed_at - j.start_after) * 1e6)::bigint AS us
           FROM job_closures z
           JOIN job_claims k ON k.ready_seq = z.ready_seq
           JOIN jobs j ON j.id = z.job_id
          WHERE z.outcome = 'completed'
            AND z.closed_at >= to_timestamp($1) AND z.closed_at < to_timestamp($2)",
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
        "SELECT relname::text AS relname, n_dead_tup AS n, autovacuum_count AS autovacuums
           FROM pg_stat_user_tables
          WHERE schemaname = 'public' AND relname <> '__diesel_schema_migrations'",
    )
    .load(conn)
    .await?;
    let running: Vec<Vacuum> = diesel::sql_query(
        "SELECT c.relname::text AS relname, v.phase::text AS phase,
                coalesce(extract(epoch FROM clock_timestamp() - a.xact_start), 0)::float8
                  AS running_s
           FROM pg_stat_progress_vacuum v
           JOIN pg_class c ON c.oid = v.relid
           LEFT JOIN pg_stat_activity a ON a.pid = v.pid
          WHERE v.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
          ORDER BY c.relname",
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
        autovacuums: dead
            .iter()
            .filter(|d| d.autovacuums > 0)
            .map(|d| (d.relname.clone(), d.autovacuums))
            .collect(),
        dead: dead.into_iter().map(|d| (d.relname, d.n)).collect(),
        vacuums_running: running
            .into_iter()
            .map(
                |v| json!({"table": v.relname, "phase": v.phase, "running_s": round1(v.running_s)}),
            )
            .collect(),
        index_bytes,
    })
}

pub(super) fn phase_summary(
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

/// What each phase collected, window by window.
pub(super) struct PhaseTotals {
    pub hist: Vec<Histogram<u64>>,
    pub done: [u64; PHASES.len()],
    pub offered: [u64; PHASES.len()],
}

/// The run's summary: each phase's rate and pickups, the stress's ratios, when
/// the recovery reached the offered rate again, and the dead tuples' median and
/// maximum (the warm-up left out).
pub(super) fn summarize(
    samples: &[serde_json::Value],
    totals: &PhaseTotals,
    durations: [f64; PHASES.len()],
    offered_jobs: f64,
    stress_offered: f64,
) -> serde_json::Map<String, serde_json::Value> {
    let stress_from = durations[0] + durations[CLEAN];
    let mut summary = serde_json::Map::new();
    for (k, name) in PHASES.iter().enumerate().skip(CLEAN) {
        summary.insert(
            (*name).into(),
            phase_summary(
                &totals.hist[k],
                totals.done[k],
                durations[k],
                totals.offered[k] as f64 / durations[k],
            ),
        );
    }
    let clean_p99 = quantile_ms(&totals.hist[CLEAN], 0.99);
    let stress_p99 = quantile_ms(&totals.hist[STRESS], 0.99);
    let stress_rate = totals.done[STRESS] as f64 / durations[STRESS];
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
        .map(|t| round1(t - stress_from - durations[STRESS]));
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
    summary
}
