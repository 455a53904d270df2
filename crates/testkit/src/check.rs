//! The core's invariants for ANY pipeline, read from the database after the fact
//! (SQL only: it trusts nothing a worker remembers): no double execution, no
//! stale lineage, no lost stage, attempt histories that match their runs. A team
//! runs it at the end of its own fault and soak tests; its own tables' checks
//! (rows written by an attempt that did not succeed, say) are its own.

use std::collections::BTreeMap;

use diesel::sql_types::{Array, BigInt, Bool, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::RepoError;
use idemstage_persistence::map_diesel_error;
use idemstage_stage::Pipeline;

/// What the database says about the runs of a pipeline, read after the fact.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Invariants {
    /// Items registered.
    pub items: i64,
    /// Items whose every expected stage is final (success, dead or cancelled)
    /// or waiting (for a signal or a timer: nothing to do until it comes).
    pub items_final: i64,
    /// `stage_runs` counted by status.
    pub runs_by_status: BTreeMap<String, i64>,
    /// Runs with status `success`.
    pub stages_succeeded: i64,
    /// Attempts that ended `failed` or `abandoned` and were followed by another.
    pub retries: i64,
    /// Attempts that lost their lease and were refused at commit.
    pub fenced: i64,
    /// Runs waiting for a signal or a timer (`waiting`): not lost, not final.
    pub waiting: i64,
    /// Waits still open two minutes past their deadline (must be 0): a wait
    /// nobody ended (the reconciler ends each within its interval).
    pub overdue_waits: i64,
    /// Successful attempts of a run that computed the same thing as the run's
    /// previous success: the same input hash and upstream attempt, with no
    /// operator rerun (`stage_reruns`) asked for between the two (must be 0).
    pub double_executions: i64,
    /// Successful runs not computed from their upstream's current successful
    /// attempt (the first stage: from the item's stored input), or from another
    /// stage than the one before them in the pipeline (must be 0).
    pub stale_lineage: i64,
    /// Successful gathers not computed from every child's final state: their
    /// fan-out is not complete, or a child ended after the gather's success
    /// and the gather was not made to run again (must be 0).
    pub stale_gathers: i64,
    /// Children whose end (a dead or cancelled stage, their last stage's
    /// success, a stop) was not counted on their fan-out (must be 0): their
    /// gather would never run.
    pub children_uncounted: i64,
    /// Expected stages that are not final (must be 0 at the end): the first stage
    /// of every item, and each later stage whose upstream has a current success
    /// that did not stop the item.
    pub lost_stages: i64,
    /// Runs whose attempt history does not match the run: a missing attempt row, an
    /// attempt still `running` that is not the run's live attempt, or a `success`
    /// run whose success attempt is not recorded as a success (must be 0).
    pub attempt_history_errors: i64,
    /// Jobs still queued, retrying or active (0 once everything is quiet).
    pub live_jobs: i64,
}

#[derive(QueryableByName)]
struct Kv {
    #[diesel(sql_type = Text)]
    k: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    v: Option<i64>,
}

/// `$1` the pipeline's stage names, in order; `$2` each one's upstream (NULL:
/// it reads its item's input); `$3` whether it runs per child of a fan-out;
/// `$4` whether it is a gather.
const CHECK_SQL: &str = "
WITH stage_order AS (
    SELECT s.stage, s.upstream, s.per_child, s.gather, s.pos
      FROM unnest($1::text[], $2::text[], $3::bool[], $4::bool[])
           WITH ORDINALITY AS s(stage, upstream, per_child, gather, pos)
),
expected AS (
    SELECT a.tenant_id, a.id AS item_id, o.stage
      FROM items a
      LEFT JOIN fanout_children c ON c.tenant_id = a.tenant_id AND c.item_id = a.id
      JOIN stage_order o ON o.upstream IS NULL AND o.per_child = (c.item_id IS NOT NULL)
     WHERE a.superseded_at IS NULL
    UNION ALL
    SELECT u.tenant_id, u.item_id, o.stage
      FROM stage_runs u JOIN stage_order o ON o.upstream = u.stage
     WHERE u.success_attempt IS NOT NULL
       AND u.stopped_attempt IS DISTINCT FROM u.success_attempt
       AND (NOT o.gather OR EXISTS (
               SELECT 1 FROM fanouts f
                WHERE f.tenant_id = u.tenant_id AND f.parent_item = u.item_id
                  AND f.stage = u.stage AND f.attempt = u.success_attempt
                  AND f.completed_at IS NOT NULL))
),
open_stages AS (
    SELECT e.* FROM expected e
      LEFT JOIN stage_runs r USING (tenant_id, item_id, stage)
     WHERE r.status IS NULL OR r.status NOT IN ('success', 'dead', 'cancelled', 'waiting')
)
SELECT 'items' AS k, (SELECT count(*) FROM items) AS v
UNION ALL SELECT 'items_final',
    (SELECT count(*) FROM items a WHERE NOT EXISTS (
        SELECT 1 FROM open_stages o WHERE o.tenant_id = a.tenant_id AND o.item_id = a.id))
UNION ALL SELECT 'lost_stages', (SELECT count(*) FROM open_stages)
UNION ALL SELECT 'retries',
    (SELECT count(*) FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id
      WHERE a.outcome IN ('failed', 'abandoned') AND a.attempt < r.attempts)
UNION ALL SELECT 'overdue_waits',
    (SELECT count(*) FROM stage_waits w
      WHERE w.ended_at IS NULL AND w.wait_until < now() - interval '2 minutes')
UNION ALL SELECT 'waiting',
    (SELECT count(*) FROM stage_runs WHERE status = 'waiting')
UNION ALL SELECT 'fenced', (SELECT count(*) FROM stage_run_attempts WHERE outcome = 'fenced')
UNION ALL SELECT 'double_executions',
    (SELECT count(*) FROM (
        SELECT run_id, attempt, input_hash, upstream_attempt,
               lag(attempt) OVER w AS prev_attempt,
               lag(input_hash) OVER w AS prev_hash, lag(upstream_attempt) OVER w AS prev_upstream,
               row_number() OVER w AS n
          FROM stage_run_attempts WHERE outcome = 'success'
        WINDOW w AS (PARTITION BY run_id ORDER BY attempt)) s
      WHERE n > 1 AND prev_hash = input_hash
        AND prev_upstream IS NOT DISTINCT FROM upstream_attempt
        AND NOT EXISTS (SELECT 1 FROM stage_reruns x
                         WHERE x.run_id = s.run_id AND x.after_attempt >= s.prev_attempt
                           AND x.after_attempt < s.attempt))
UNION ALL SELECT 'stale_lineage',
    (SELECT count(*) FROM stage_runs d JOIN stage_order o ON o.stage = d.stage
      WHERE d.status = 'success'
        AND (d.upstream_stage IS DISTINCT FROM o.upstream
             OR (d.upstream_stage IS NULL AND NOT EXISTS (
                    SELECT 1 FROM items a
                     WHERE a.tenant_id = d.tenant_id AND a.id = d.item_id
                       AND a.input_sha256 = d.input_hash))
             OR (d.upstream_stage IS NOT NULL AND NOT EXISTS (
                    SELECT 1 FROM stage_runs u
                     WHERE u.tenant_id = d.tenant_id AND u.item_id = d.item_id
                       AND u.stage = d.upstream_stage AND u.success_attempt = d.upstream_attempt))))
UNION ALL SELECT 'stale_gathers',
    (SELECT count(*) FROM stage_runs g JOIN stage_order o ON o.stage = g.stage AND o.gather
      WHERE g.status = 'success'
        AND NOT EXISTS (
            SELECT 1 FROM fanouts f
             WHERE f.tenant_id = g.tenant_id AND f.parent_item = g.item_id
               AND f.stage = g.upstream_stage AND f.attempt = g.upstream_attempt
               AND f.completed_at IS NOT NULL
               AND NOT EXISTS (
                   SELECT 1 FROM fanout_children c
                    WHERE c.tenant_id = f.tenant_id AND c.parent_item = f.parent_item
                      AND c.stage = f.stage AND c.attempt = f.attempt
                      AND (c.outcome IS NULL OR c.finished_at > g.finished_at))))
UNION ALL SELECT 'children_uncounted',
    (SELECT count(*) FROM fanout_children c JOIN stage_order o ON o.per_child
       JOIN stage_runs r ON r.tenant_id = c.tenant_id AND r.item_id = c.item_id AND r.stage = o.stage
      WHERE c.outcome IS NULL
        AND (r.status IN ('dead', 'cancelled')
             OR (r.status = 'success'
                 AND (r.stopped_attempt = r.success_attempt
                      OR NOT EXISTS (SELECT 1 FROM stage_order n
                                      WHERE n.per_child AND n.upstream = o.stage)))))
UNION ALL SELECT 'attempt_history_errors',
    (SELECT count(*) FROM stage_runs r
      WHERE (SELECT count(*) FROM stage_run_attempts a WHERE a.run_id = r.id) <> r.attempts
         OR EXISTS (SELECT 1 FROM stage_run_attempts a
                     WHERE a.run_id = r.id AND a.outcome = 'running'
                       AND (a.attempt <> r.attempts OR r.status <> 'running'))
         OR (r.status = 'success' AND NOT EXISTS (
                SELECT 1 FROM stage_run_attempts a
                 WHERE a.run_id = r.id AND a.attempt = r.success_attempt
                   AND a.outcome = 'success')))
UNION ALL SELECT 'live_jobs', (SELECT count(*) FROM job_states WHERE state IN ('created', 'retry', 'active'))
UNION ALL SELECT 'status:' || status, count(*) FROM stage_runs GROUP BY status
";

/// Reads the core's invariants for `pipeline`'s runs (one statement) on `conn`,
/// which must see every tenant's rows (an owner's connection, e.g.
/// [`TestDb::conn`](crate::TestDb::conn), not a tenant-scoped one).
pub async fn check_pipeline(
    conn: &mut AsyncPgConnection,
    pipeline: &Pipeline,
) -> Result<Invariants, RepoError> {
    let shape = pipeline.shape();
    let stages: Vec<&str> = shape.iter().map(|s| s.0.as_str()).collect();
    let upstreams: Vec<Option<&str>> = shape
        .iter()
        .map(|s| s.1.as_ref().map(|u| u.as_str()))
        .collect();
    let per_child: Vec<bool> = shape.iter().map(|s| s.2).collect();
    let gathers: Vec<bool> = shape.iter().map(|s| s.3).collect();
    let rows: Vec<Kv> = diesel::sql_query(CHECK_SQL)
        .bind::<Array<Text>, _>(stages)
        .bind::<Array<Nullable<Text>>, _>(upstreams)
        .bind::<Array<Bool>, _>(per_child)
        .bind::<Array<Bool>, _>(gathers)
        .load(conn)
        .await
        .map_err(map_diesel_error)?;
    let mut check = Invariants::default();
    for Kv { k, v } in rows {
        let v = v.unwrap_or(0);
        match k.as_str() {
            "items" => check.items = v,
            "items_final" => check.items_final = v,
            "lost_stages" => check.lost_stages = v,
            "retries" => check.retries = v,
            "fenced" => check.fenced = v,
            "overdue_waits" => check.overdue_waits = v,
            "waiting" => check.waiting = v,
            "double_executions" => check.double_executions = v,
            "stale_lineage" => check.stale_lineage = v,
            "stale_gathers" => check.stale_gathers = v,
            "children_uncounted" => check.children_uncounted = v,
            "attempt_history_errors" => check.attempt_history_errors = v,
            "live_jobs" => check.live_jobs = v,
            status => {
                let status = status.trim_start_matches("status:").to_owned();
                check.runs_by_status.insert(status, v);
            }
        }
    }
    check.stages_succeeded = check.runs_by_status.get("success").copied().unwrap_or(0);
    Ok(check)
}

impl Invariants {
    /// The invariants that must hold once every item is final (empty: all hold).
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let counts = [
            (self.double_executions, "double executions"),
            (
                self.stale_lineage,
                "successes not computed from their upstream's current success",
            ),
            (self.lost_stages, "lost stages"),
            (
                self.stale_gathers,
                "gathers not computed from every child's final state",
            ),
            (
                self.children_uncounted,
                "children whose end was not counted",
            ),
            (self.overdue_waits, "waits open past their deadline"),
            (
                self.attempt_history_errors,
                "runs whose attempt history does not match",
            ),
        ];
        for (n, what) in counts {
            if n != 0 {
                v.push(format!("{n} {what}"));
            }
        }
        if self.items_final != self.items {
            v.push(format!(
                "{} of {} items did not reach a final state",
                self.items - self.items_final,
                self.items
            ));
        }
        v
    }

    /// Every item final and no job left queued, retrying or active: the state
    /// in which a fault test checks [`violations`](Self::violations).
    pub fn is_quiet(&self) -> bool {
        self.items_final == self.items && self.live_jobs == 0
    }
}
