//! The deadlines of durable waits: each wait past its deadline ends as it said
//! ([`OnTimeout`](idemstage_domain::OnTimeout)): the run `dead`, or running
//! again (with a job) and reading the signal as timed out. Run by every
//! `PipelineWorker` each `wait_interval`; safe beside any number of others (each
//! wait is ended by a conditional write under the run's row lock).

use diesel::sql_types::{Integer, Text};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, RepoError, RunId, StageName, TenantId};

use crate::error::{map_diesel_error, TxError};
use crate::ops::RetryPlanner;

/// What one pass of [`expire_due`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpiredWaits {
    /// Waits that ended their run `dead`.
    pub failed: usize,
    /// Waits whose run runs again (a job sent).
    pub resumed: usize,
    /// Waits whose run had moved on (cancelled, invalidated): closed.
    pub gone: usize,
}

/// The open waits of the stages `$2` past their deadline, oldest first
/// (`stage_waits_open_idx`). `$1` how many.
pub(crate) const DUE: &str = "\
SELECT tenant_id, run_id, attempt FROM stage_waits
 WHERE ended_at IS NULL AND wait_until <= clock_timestamp() AND stage = ANY($2::text[])
 ORDER BY wait_until
 LIMIT $1";

/// Ends one wait past its deadline, in its tenant's scope: `timeout` if its run
/// still waits in that attempt (then the run is `dead`, or claimable with one
/// more attempt in its budget, and the item's stored input hash for its job
/// comes back with it), else `gone` (the attempt trigger ends a wait whose run
/// stops waiting otherwise, so this is only a guard). `$1` run, `$2` attempt.
pub(crate) const EXPIRE: &str = "\
WITH run AS (
    SELECT id, attempts, status FROM stage_runs WHERE id = $1 FOR UPDATE),
ended AS (
    UPDATE stage_waits w
       SET ended_at = clock_timestamp(),
           ended_by = CASE WHEN run.status = 'waiting' AND run.attempts = w.attempt
                           THEN 'timeout' ELSE 'gone' END
      FROM run
     WHERE w.run_id = run.id AND w.attempt = $2 AND w.ended_at IS NULL
       AND w.wait_until <= clock_timestamp()
    RETURNING w.ended_by, w.on_timeout, w.signal, w.wait_until),
moved AS (
    UPDATE stage_runs r
       SET status = CASE WHEN ended.on_timeout = 'fail' THEN 'dead' ELSE 'running' END,
           finished_at = CASE WHEN ended.on_timeout = 'fail' THEN clock_timestamp()
                              ELSE r.finished_at END,
           lease_expires_at = clock_timestamp(),
           max_attempts = CASE WHEN ended.on_timeout = 'fail' THEN r.max_attempts
                               ELSE r.max_attempts + 1 END,
           last_error = CASE WHEN ended.signal IS NULL THEN 'timer elapsed'
                             ELSE 'no signal ' || ended.signal || ' by ' || ended.wait_until
                                  || ': timed out' END
      FROM ended
     WHERE r.id = $1 AND r.attempts = $2 AND r.status = 'waiting' AND ended.ended_by = 'timeout'
    RETURNING r.item_id, r.stage, r.status,
              (SELECT a.input_sha256 FROM items a
                WHERE a.tenant_id = r.tenant_id AND a.id = r.item_id) AS input_hash)
SELECT ended.ended_by, moved.item_id, moved.stage, moved.status, moved.input_hash
  FROM ended LEFT JOIN moved ON true";

#[derive(QueryableByName)]
struct Due {
    #[diesel(sql_type = Text)]
    tenant_id: String,
    #[diesel(sql_type = Text)]
    run_id: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
}

#[derive(QueryableByName)]
struct Expired {
    #[diesel(sql_type = Text)]
    ended_by: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    item_id: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    stage: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    status: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    input_hash: Option<String>,
}

/// Ends up to `limit` waits of `stages` (the planner's) past their deadline
/// (see the module); each in a transaction of its own, scoped to its tenant, a
/// resumed one's job sent in it (`planner.job`, with the item's stored input
/// hash).
pub async fn expire_due(
    conn: &mut AsyncPgConnection,
    stages: &[StageName],
    planner: &dyn RetryPlanner,
    limit: u32,
) -> Result<ExpiredWaits, RepoError> {
    let names: Vec<String> = stages.iter().map(|s| s.as_str().to_owned()).collect();
    let due: Vec<Due> = crate::db::pinned(conn, async |conn| {
        diesel::sql_query(DUE)
            .bind::<Integer, _>(i32::try_from(limit).unwrap_or(i32::MAX))
            .bind::<diesel::sql_types::Array<Text>, _>(names)
            .load(conn)
            .await
    })
    .await
    .map_err(map_diesel_error)?;
    let mut report = ExpiredWaits::default();
    for d in due {
        let tenant = TenantId::parse(&d.tenant_id)?;
        let run = RunId::parse(&d.run_id)?;
        let ended = crate::tenant::transaction::<_, TxError, _>(conn, &tenant, async |conn| {
            let ended: Option<Expired> = diesel::sql_query(EXPIRE)
                .bind::<Text, _>(run.to_string())
                .bind::<Integer, _>(d.attempt)
                .get_result(conn)
                .await
                .optional()?;
            let Some(ended) = ended else {
                return Ok(None);
            };
            if let (Some(item), Some(stage), Some("running"), Some(hash)) = (
                &ended.item_id,
                &ended.stage,
                ended.status.as_deref(),
                &ended.input_hash,
            ) {
                let item = ItemId::parse(item).map_err(|e| TxError::Repo(e.into()))?;
                let stage = StageName::parse(stage).map_err(|e| TxError::Repo(e.into()))?;
                crate::queue::send_in(conn, &planner.job(&stage, &tenant, &item, hash)).await?;
            }
            Ok(Some(ended))
        })
        .await
        .map_err(TxError::into_repo)?;
        match ended {
            Some(e) if e.ended_by == "gone" => report.gone += 1,
            Some(e) if e.status.as_deref() == Some("dead") => report.failed += 1,
            Some(e) if e.status.as_deref() == Some("running") => report.resumed += 1,
            _ => {}
        }
    }
    Ok(report)
}
