//! The example's invariant checker: what the database says about a run of the
//! example pipeline, read after the fact (by `idemstage demo`, `idemstage bench`
//! and the fault tests). SQL only: it trusts nothing a worker remembers.

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Nullable, Text};
use idemstage::diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::{db::map_diesel_error, db::RepoError};

mod bound;

/// What the database says about a run of the example pipeline, read after the fact.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PipelineCheck {
    /// Items registered.
    pub items: i64,
    /// Items whose every expected stage is final (success, dead or cancelled).
    pub items_final: i64,
    /// `feasibility_results` rows that say feasible.
    pub feasible: i64,
    /// `feasibility_results` rows that say infeasible.
    pub infeasible: i64,
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
    /// previous success: same input hash and same upstream attempt (must be 0). A
    /// rerun on new input, on a new upstream success, or one an operator asked
    /// for (`stage_reruns`), is not a double execution.
    pub double_executions: i64,
    /// Successful runs not computed from their upstream's current successful attempt
    /// (or, for the first stage, from the item's stored input), or from another
    /// stage than the one before them (must be 0).
    pub stale_lineage: i64,
    /// Current results of extract, feasibility and calculate that differ from what
    /// the input their run is bound to (`input_hash`) computes, or whose bound input
    /// is not stored (must be 0): a stage that read another input than its lineage
    /// names.
    pub unbound_results: i64,
    /// Child rows and results written by an attempt other than the run's current
    /// success, and audit entries written by an attempt that did not succeed
    /// (must be 0).
    pub foreign_writes: i64,
    /// Expected stages that are not final (`success`, `dead` or `cancelled`; must be
    /// 0 at the end). A cancelled stage is final: neither lost nor run again.
    pub lost_stages: i64,
    /// Audit entries naming a file id that does not exist (must be 0).
    pub dangling_audit: i64,
    /// Files (`dateien`) that no successful attempt (of any lineage) created or
    /// reused, i.e. written by an attempt that did not succeed (must be 0).
    pub orphan_files: i64,
    /// Successful runs of intake, extract or calculate without their audit entry from
    /// the successful attempt (must be 0).
    pub missing_audit: i64,
    /// Runs whose attempt history does not match the run: a missing attempt row, an
    /// attempt still `running` that is not the run's live attempt, or a `success` run
    /// whose success attempt is not recorded as a success (must be 0).
    pub attempt_history_errors: i64,
    /// Attempts that ended `fenced` or `abandoned`: stale workers seen (informational).
    pub abandoned: i64,
    /// Jobs still queued, retrying or active (0 once everything is quiet).
    pub live_jobs: i64,
    /// Jobs that ended `failed` (informational; a bad job, or a dead stage).
    pub failed_jobs: i64,
}

#[derive(QueryableByName)]
struct Kv {
    #[diesel(sql_type = Text)]
    k: String,
    #[diesel(sql_type = Nullable<BigInt>)]
    v: Option<i64>,
}

/// Lost stages of the example pipeline: intake is always expected; extract and
/// feasibility once the stage before has a current success; calculate once a
/// current feasibility result says feasible. (A stage whose upstream's rerun died
/// after invalidating it is blocked, not lost: nothing can be computed for it.)
const CHECK_SQL: &str = "
WITH stage_order(stage, upstream) AS (
    VALUES ('intake', NULL), ('extract', 'intake'), ('feasibility', 'extract'),
           ('calculate', 'feasibility')
),
expected AS (
    SELECT a.tenant_id, a.id AS item_id, 'intake' AS stage FROM items a
    UNION ALL
    SELECT u.tenant_id, u.item_id, o.stage
      FROM stage_runs u JOIN stage_order o ON o.upstream = u.stage
     WHERE u.success_attempt IS NOT NULL AND o.stage <> 'calculate'
    UNION ALL
    SELECT f.tenant_id, f.item_id, 'calculate'
      FROM feasibility_results f
      JOIN stage_runs r ON r.tenant_id = f.tenant_id AND r.item_id = f.item_id
                          AND r.stage = 'feasibility' AND r.success_attempt = f.attempt
     WHERE f.feasible
),
open_stages AS (
    SELECT e.* FROM expected e
      LEFT JOIN stage_runs r USING (tenant_id, item_id, stage)
     WHERE r.status IS NULL OR r.status NOT IN ('success', 'dead', 'cancelled', 'waiting')
),
-- The attempt whose writes stand: the current success, or for a run invalidated
-- since (stale, and blocked if its upstream's rerun died), its last success.
success_attempt AS (
    SELECT r.id AS run_id,
           coalesce(r.success_attempt,
                    (SELECT max(a.attempt) FROM stage_run_attempts a
                      WHERE a.run_id = r.id AND a.outcome = 'success')) AS attempt
      FROM stage_runs r
),
-- Every attempt that succeeded: the audit log is append-only, so the entries (and
-- files) of an earlier lineage's success stay, and are no foreign writes.
succeeded AS (
    SELECT run_id, attempt FROM stage_run_attempts WHERE outcome = 'success'
)
SELECT 'items' AS k, (SELECT count(*) FROM items) AS v
UNION ALL SELECT 'items_final',
    (SELECT count(*) FROM items a WHERE NOT EXISTS (
        SELECT 1 FROM open_stages o WHERE o.tenant_id = a.tenant_id AND o.item_id = a.id))
UNION ALL SELECT 'feasible', (SELECT count(*) FROM feasibility_results WHERE feasible)
UNION ALL SELECT 'infeasible', (SELECT count(*) FROM feasibility_results WHERE NOT feasible)
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
UNION ALL SELECT 'foreign_writes',
    (SELECT count(*) FROM anfrage_extraktionen x
      WHERE NOT EXISTS (SELECT 1 FROM success_attempt s WHERE s.run_id = x.run_id AND s.attempt = x.attempt))
  + (SELECT count(*) FROM feasibility_results x
      WHERE NOT EXISTS (SELECT 1 FROM success_attempt s WHERE s.run_id = x.run_id AND s.attempt = x.attempt))
  + (SELECT count(*) FROM calculation_results x
      WHERE NOT EXISTS (SELECT 1 FROM success_attempt s WHERE s.run_id = x.run_id AND s.attempt = x.attempt))
  + (SELECT count(*) FROM audit_log x WHERE x.run_id IS NOT NULL
        AND NOT EXISTS (SELECT 1 FROM succeeded s WHERE s.run_id = x.run_id AND s.attempt = x.attempt))
UNION ALL SELECT 'dangling_audit',
    (SELECT count(*) FROM audit_log l WHERE l.action LIKE 'datei.%'
        AND NOT EXISTS (SELECT 1 FROM dateien d WHERE d.id = l.entity_id))
UNION ALL SELECT 'orphan_files',
    (SELECT count(*) FROM dateien d WHERE NOT EXISTS (
        SELECT 1 FROM audit_log l JOIN succeeded s ON s.run_id = l.run_id AND s.attempt = l.attempt
         WHERE l.entity_id = d.id AND l.action IN ('datei.created', 'datei.reused')))
UNION ALL SELECT 'missing_audit',
    (SELECT count(*) FROM stage_runs r
      WHERE r.status = 'success' AND r.stage IN ('intake', 'extract', 'calculate')
        AND NOT EXISTS (SELECT 1 FROM audit_log l
                         WHERE l.run_id = r.id AND l.attempt = r.success_attempt
                           AND l.action = CASE r.stage WHEN 'intake' THEN 'item.intake'
                                                       WHEN 'extract' THEN 'item.extracted'
                                                       ELSE 'item.calculated' END))
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
UNION ALL SELECT 'abandoned',
    (SELECT count(*) FROM stage_run_attempts WHERE outcome IN ('fenced', 'abandoned'))
UNION ALL SELECT 'live_jobs', (SELECT count(*) FROM job_states WHERE state IN ('created', 'retry', 'active'))
UNION ALL SELECT 'failed_jobs', (SELECT count(*) FROM job_states WHERE state = 'failed')
UNION ALL SELECT 'status:' || status, count(*) FROM stage_runs GROUP BY status
";

/// Runs the checker (one statement) on `conn`, which must see every tenant's rows
/// (an owner's connection, not a tenant-scoped one).
pub async fn check_example_pipeline(
    conn: &mut AsyncPgConnection,
) -> Result<PipelineCheck, RepoError> {
    let rows: Vec<Kv> = diesel::sql_query(CHECK_SQL)
        .load(conn)
        .await
        .map_err(map_diesel_error)?;
    let mut check = PipelineCheck::default();
    for Kv { k, v } in rows {
        let v = v.unwrap_or(0);
        match k.as_str() {
            "items" => check.items = v,
            "items_final" => check.items_final = v,
            "feasible" => check.feasible = v,
            "infeasible" => check.infeasible = v,
            "lost_stages" => check.lost_stages = v,
            "retries" => check.retries = v,
            "fenced" => check.fenced = v,
            "overdue_waits" => check.overdue_waits = v,
            "waiting" => check.waiting = v,
            "double_executions" => check.double_executions = v,
            "stale_lineage" => check.stale_lineage = v,
            "foreign_writes" => check.foreign_writes = v,
            "dangling_audit" => check.dangling_audit = v,
            "orphan_files" => check.orphan_files = v,
            "missing_audit" => check.missing_audit = v,
            "attempt_history_errors" => check.attempt_history_errors = v,
            "abandoned" => check.abandoned = v,
            "live_jobs" => check.live_jobs = v,
            "failed_jobs" => check.failed_jobs = v,
            status => {
                let status = status.trim_start_matches("status:").to_owned();
                check.runs_by_status.insert(status, v);
            }
        }
    }
    check.stages_succeeded = check.runs_by_status.get("success").copied().unwrap_or(0);
    check.unbound_results = bound::unbound_results(conn).await?;
    Ok(check)
}

impl PipelineCheck {
    /// The invariants that must hold once every item is final.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.double_executions != 0 {
            v.push(format!("{} double executions", self.double_executions));
        }
        if self.stale_lineage != 0 {
            v.push(format!(
                "{} successes not computed from their upstream's current success",
                self.stale_lineage
            ));
        }
        if self.unbound_results != 0 {
            v.push(format!(
                "{} results not computed from the input their run is bound to",
                self.unbound_results
            ));
        }
        if self.foreign_writes != 0 {
            v.push(format!(
                "{} rows written by a non-successful attempt",
                self.foreign_writes
            ));
        }
        if self.overdue_waits != 0 {
            v.push(format!(
                "{} waits open past their deadline",
                self.overdue_waits
            ));
        }
        if self.lost_stages != 0 {
            v.push(format!("{} lost stages", self.lost_stages));
        }
        if self.items_final != self.items {
            v.push(format!(
                "{} of {} items did not reach a final state",
                self.items - self.items_final,
                self.items
            ));
        }
        if self.dangling_audit != 0 {
            v.push(format!(
                "{} audit entries name a missing file",
                self.dangling_audit
            ));
        }
        if self.orphan_files != 0 {
            v.push(format!(
                "{} files not created or reused by a successful attempt",
                self.orphan_files
            ));
        }
        if self.missing_audit != 0 {
            v.push(format!(
                "{} successful runs without their audit entry",
                self.missing_audit
            ));
        }
        if self.attempt_history_errors != 0 {
            v.push(format!(
                "{} runs whose attempt history does not match",
                self.attempt_history_errors
            ));
        }
        v
    }

    /// Every item final and no job left queued, retrying or active: the state in
    /// which fault tests check `violations()`.
    pub fn is_quiet(&self) -> bool {
        self.items_final == self.items && self.live_jobs == 0
    }
}
