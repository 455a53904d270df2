//! Layer 1: the claim repository on `pipeline_runs`.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::dsl::{now, IntervalDsl};
use diesel::pg::data_types::PgInterval;
use diesel::prelude::*;
use diesel::sql_types::{Bool, Text, Timestamptz};
use diesel::upsert::excluded;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    AnfrageId, AttemptRecord, ClaimOutcome, ClaimRequest, ClaimToken, CompleteOutcome, FailOutcome,
    FencedWrite, InputChangePolicy, RejectReason, RenewOutcome, RepoError, RunId, RunRecord,
    RunRepository, RunStatus, SkipReason, StageError, StageName, TenantId,
};

use crate::cached::Cached;
use crate::error::{map_diesel_error, TxError};
use crate::fenced::PgFencedTx;
use crate::schema::{pipeline_run_attempts, pipeline_runs};
use crate::PgPool;

/// How often a transaction is re-run after 40001/40P01 before the error is returned.
const CONFLICT_RETRIES: u32 = 8;

#[derive(Clone)]
pub struct PgRunRepository {
    pool: PgPool,
}

impl PgRunRepository {
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn conn(&self) -> Result<crate::db::PooledConn<'_>, RepoError> {
        crate::db::get(&self.pool).await
    }
}

#[derive(Insertable)]
#[diesel(table_name = pipeline_runs)]
struct NewRun<'a> {
    id: String,
    tenant_id: &'a str,
    anfrage_id: String,
    stage: &'a str,
    status: &'a str,
    attempts: i32,
    max_attempts: i32,
    input_hash: &'a str,
    worker_id: &'a str,
}

#[derive(Queryable, Selectable)]
#[diesel(table_name = pipeline_runs)]
struct RunRow {
    id: String,
    tenant_id: String,
    anfrage_id: String,
    stage: String,
    status: String,
    attempts: i32,
    max_attempts: i32,
    input_hash: String,
    worker_id: String,
    started_at: DateTime<Utc>,
    lease_expires_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
}

impl RunRow {
    fn into_record(self) -> Result<RunRecord, RepoError> {
        Ok(RunRecord {
            run_id: RunId::parse(&self.id)?,
            tenant: TenantId::parse(&self.tenant_id)?,
            anfrage: AnfrageId::parse(&self.anfrage_id)?,
            stage: StageName::parse(&self.stage)?,
            status: self.status.parse()?,
            attempts: self.attempts,
            max_attempts: self.max_attempts,
            input_hash: self.input_hash,
            worker_id: self.worker_id,
            started_at: self.started_at,
            lease_expires_at: self.lease_expires_at,
            finished_at: self.finished_at,
            last_error: self.last_error,
        })
    }
}

pub(crate) fn interval(d: Duration) -> PgInterval {
    i64::try_from(d.as_micros())
        .unwrap_or(i64::MAX)
        .microseconds()
}

/// The claim statement. `DO UPDATE … WHERE` (the `.filter` after `.set`) is the guard.
/// A predicate on the conflict target (`ON CONFLICT (…) WHERE`) would only pick the
/// arbiter index and filter nothing: a finished stage would be claimed again.
async fn claim_statement(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<Option<(String, i32, DateTime<Utc>)>, diesel::result::Error> {
    use pipeline_runs::dsl as pr;
    let lease = interval(req.policy.lease);
    let run_id = RunId::new().to_string();
    let row = NewRun {
        id: run_id,
        tenant_id: req.tenant.as_str(),
        anfrage_id: req.anfrage.to_string(),
        stage: req.stage.as_str(),
        status: RunStatus::Running.as_str(),
        attempts: 1,
        max_attempts: req.policy.max_attempts,
        input_hash: &req.input_hash,
        worker_id: req.worker.as_str(),
    };
    let db_now = now.into_sql::<Timestamptz>();
    let reclaimable = pr::status.eq_any(["failed", "stale"]).or(pr::status
        .eq("running")
        .and(pr::lease_expires_at.lt(db_now)));
    let within_budget = pr::attempts.lt(pr::max_attempts);
    let rerun_on_new_input = pr::status
        .eq("success")
        .and(pr::input_hash.ne(excluded(pr::input_hash)))
        // A bound parameter, not SQL text: the statement stays the same for both
        // policies, so Diesel can cache its prepared form.
        .and((req.policy.on_input_change == InputChangePolicy::Rerun).into_sql::<Bool>());
    let guard = reclaimable.and(within_budget).or(rerun_on_new_input);
    // A rerun of a finished stage gets a fresh attempt budget on top of the used one;
    // attempts itself only ever grows, because it is the fencing token.
    let max_attempts = diesel::dsl::case_when(
        pr::status.eq("success"),
        pr::attempts + excluded(pr::max_attempts),
    )
    .otherwise(pr::max_attempts);
    Cached(
        diesel::query_dsl::methods::FilterDsl::filter(
            diesel::insert_into(pipeline_runs::table)
                .values((
                    &row,
                    pr::started_at.eq(db_now),
                    pr::lease_expires_at.eq(db_now + lease),
                ))
                .on_conflict((pr::tenant_id, pr::anfrage_id, pr::stage))
                .do_update()
                .set((
                    pr::status.eq("running"),
                    pr::attempts.eq(pr::attempts + 1),
                    pr::max_attempts.eq(max_attempts),
                    pr::input_hash.eq(excluded(pr::input_hash)),
                    pr::worker_id.eq(excluded(pr::worker_id)),
                    pr::started_at.eq(db_now),
                    pr::lease_expires_at.eq(db_now + lease),
                    pr::finished_at.eq(None::<DateTime<Utc>>),
                    pr::last_error.eq(None::<String>),
                )),
            guard,
        )
        .returning((pr::id, pr::attempts, pr::lease_expires_at)),
    )
    .get_result(conn)
    .await
    .optional()
}

/// Marks the downstream stages of a rerun `stale` so they are claimable again. A
/// running downstream attempt is fenced by this: its completion expects `running`.
async fn mark_downstream_stale(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<usize, diesel::result::Error> {
    use pipeline_runs::dsl as pr;
    let names: Vec<&str> = req.policy.downstream.iter().map(|s| s.as_str()).collect();
    diesel::update(
        pr::pipeline_runs
            .filter(pr::tenant_id.eq(req.tenant.as_str()))
            .filter(pr::anfrage_id.eq(req.anfrage.to_string()))
            .filter(pr::stage.eq_any(names))
            .filter(pr::status.ne("dead")),
    )
    .set((
        pr::status.eq("stale"),
        pr::last_error.eq("upstream stage re-ran with new input"),
    ))
    .execute(conn)
    .await
}

fn map_claim_error(e: diesel::result::Error, req: &ClaimRequest) -> RepoError {
    use diesel::result::{DatabaseErrorKind, Error};
    match &e {
        Error::DatabaseError(DatabaseErrorKind::ForeignKeyViolation, info)
            if info.constraint_name() == Some("pipeline_runs_anfrage_fk") =>
        {
            RepoError::AnfrageNotFound {
                tenant: req.tenant.to_string(),
                anfrage: req.anfrage.to_string(),
            }
        }
        _ => map_diesel_error(e),
    }
}

/// Sleeps a little before re-running a transaction after 40001/40P01.
async fn conflict_backoff(tries: u32, msg: &str) {
    tracing::debug!(tries, %msg, "transaction conflict, retrying");
    let jitter = rand::random::<u64>() % (5 << tries.min(6));
    tokio::time::sleep(Duration::from_millis(jitter)).await;
}

/// One claim, in a transaction scoped to the request's tenant (row-level
/// security): the statement, plus, for a rerun policy with downstream stages, the
/// invalidation of those stages.
async fn claim_once(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<Option<(String, i32, DateTime<Utc>)>, RepoError> {
    let rerun =
        req.policy.on_input_change == InputChangePolicy::Rerun && !req.policy.downstream.is_empty();
    conn.transaction::<_, diesel::result::Error, _>(async move |conn| {
        crate::tenant::scope(conn, &req.tenant).await?;
        let claimed = claim_statement(conn, req).await?;
        if rerun && claimed.as_ref().is_some_and(|(_, attempt, _)| *attempt > 1) {
            mark_downstream_stale(conn, req).await?;
        }
        Ok(claimed)
    })
    .await
    .map_err(|e| map_claim_error(e, req))
}

#[async_trait]
impl RunRepository for PgRunRepository {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, RepoError> {
        req.policy.validate()?;
        let mut conn = self.conn().await?;
        // The guard can say no because of a state that changes right after (a lease
        // that just ran out); a few rounds of claim-then-explain settle it.
        let mut conflicts = 0;
        for _ in 0..3 {
            let claimed = match claim_once(&mut conn, req).await {
                Err(RepoError::Conflict(msg)) if conflicts < CONFLICT_RETRIES => {
                    conflicts += 1;
                    conflict_backoff(conflicts, &msg).await;
                    continue;
                }
                other => other?,
            };
            if let Some((run_id, attempt, lease_expires_at)) = claimed {
                return Ok(ClaimOutcome::Claimed {
                    run_id: RunId::parse(&run_id)?,
                    attempt,
                    lease_expires_at,
                });
            }
            let explained = conn
                .transaction::<_, TxError, _>(async |conn| {
                    crate::tenant::scope(conn, &req.tenant).await?;
                    Ok(explain_skip(conn, req).await?)
                })
                .await
                .map_err(TxError::into_repo)?;
            if let Some(outcome) = explained {
                return Ok(outcome);
            }
        }
        Err(RepoError::Conflict(format!(
            "claim of {}/{}/{} kept changing state",
            req.tenant, req.anfrage, req.stage
        )))
    }

    async fn renew_lease(
        &self,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<RenewOutcome, RepoError> {
        use pipeline_runs::dsl as pr;
        let mut conn = self.conn().await?;
        let renewed: Option<DateTime<Utc>> = conn
            .transaction::<_, diesel::result::Error, _>(async |conn| {
                crate::tenant::scope(conn, &token.tenant).await?;
                diesel::update(fenced(token))
                    .set(pr::lease_expires_at.eq(now.into_sql::<Timestamptz>() + interval(lease)))
                    .returning(pr::lease_expires_at)
                    .get_result(conn)
                    .await
                    .optional()
            })
            .await
            .map_err(map_diesel_error)?;
        Ok(match renewed {
            Some(lease_expires_at) => RenewOutcome::Renewed { lease_expires_at },
            None => RenewOutcome::Fenced,
        })
    }

    async fn complete(
        &self,
        token: &ClaimToken,
        write: &FencedWrite<'_>,
    ) -> Result<CompleteOutcome, StageError> {
        let mut tries = 0;
        loop {
            let outcome = self.complete_once(token, write).await;
            match outcome {
                Ok(o) => return Ok(o),
                Err(StageError::Repo(RepoError::Conflict(msg))) if tries < CONFLICT_RETRIES => {
                    tries += 1;
                    conflict_backoff(tries, &msg).await;
                }
                Err(StageError::Repo(RepoError::Unavailable(msg))) => {
                    // The connection broke, perhaps during COMMIT: the outcome is
                    // unknown until the run is read again.
                    tracing::warn!(%msg, "connection lost during completion; re-checking");
                    match self.recheck_after_lost_connection(token).await? {
                        Recheck::Committed => return Ok(CompleteOutcome::Committed),
                        Recheck::Fenced => return Ok(CompleteOutcome::Fenced),
                        Recheck::NotCommitted if tries < CONFLICT_RETRIES => tries += 1,
                        Recheck::NotCommitted => {
                            return Err(StageError::Repo(RepoError::Unavailable(msg)))
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn fail(
        &self,
        token: &ClaimToken,
        error: &str,
        retryable: bool,
    ) -> Result<FailOutcome, RepoError> {
        use pipeline_runs::dsl as pr;
        let mut conn = self.conn().await?;
        // Cacheable: the permanent case is the same CASE with a bound flag.
        let status = diesel::dsl::case_when(
            pr::attempts
                .ge(pr::max_attempts)
                .or((!retryable).into_sql::<Bool>()),
            "dead".into_sql::<Text>(),
        )
        .otherwise("failed".into_sql::<Text>());
        let failed: Option<(String, i32)> = conn
            .transaction::<_, diesel::result::Error, _>(async |conn| {
                crate::tenant::scope(conn, &token.tenant).await?;
                diesel::update(fenced(token))
                    .set((
                        pr::status.eq(status),
                        pr::last_error.eq(truncate(error)),
                        pr::finished_at.eq(now.into_sql::<Timestamptz>().nullable()),
                    ))
                    .returning((pr::status, pr::attempts))
                    .get_result(conn)
                    .await
                    .optional()
            })
            .await
            .map_err(map_diesel_error)?;
        Ok(match failed {
            Some((status, attempts)) if status == "dead" => FailOutcome::Exhausted { attempts },
            Some((_, attempt)) => FailOutcome::WillRetry { attempt },
            None => FailOutcome::Fenced,
        })
    }

    async fn release(&self, token: &ClaimToken) -> Result<RenewOutcome, RepoError> {
        use pipeline_runs::dsl as pr;
        let mut conn = self.conn().await?;
        // Expire the lease now and give the attempt back to the budget: a shutdown is
        // not the stage's failure. The attempt row says `abandoned`.
        let released: Option<DateTime<Utc>> = conn
            .transaction::<_, TxError, _>(async |conn| {
                crate::tenant::scope(conn, &token.tenant).await?;
                let released = diesel::update(fenced(token))
                    .set((
                        pr::lease_expires_at.eq(now.into_sql::<Timestamptz>()),
                        pr::max_attempts.eq(pr::max_attempts + 1),
                        pr::last_error.eq("released by a worker shutting down"),
                    ))
                    .returning(pr::lease_expires_at)
                    .get_result(conn)
                    .await
                    .optional()?;
                mark_attempt(conn, token, "abandoned").await?;
                Ok(released)
            })
            .await
            .map_err(TxError::into_repo)?;
        Ok(match released {
            Some(lease_expires_at) => RenewOutcome::Renewed { lease_expires_at },
            None => RenewOutcome::Fenced,
        })
    }

    async fn record_fenced(&self, token: &ClaimToken) -> Result<(), RepoError> {
        let mut conn = self.conn().await?;
        conn.transaction::<_, TxError, _>(async |conn| {
            crate::tenant::scope(conn, &token.tenant).await?;
            Ok(mark_attempt(conn, token, "fenced").await?)
        })
        .await
        .map_err(TxError::into_repo)
    }

    async fn read_run(
        &self,
        tenant: &TenantId,
        anfrage: &AnfrageId,
        stage: &StageName,
    ) -> Result<Option<RunRecord>, RepoError> {
        let mut conn = self.conn().await?;
        conn.transaction::<_, TxError, _>(async |conn| {
            crate::tenant::scope(conn, tenant).await?;
            Ok(read_run(conn, tenant.as_str(), &anfrage.to_string(), stage.as_str()).await?)
        })
        .await
        .map_err(TxError::into_repo)?
        .map(RunRow::into_record)
        .transpose()
    }

    async fn attempt_history(&self, run_id: &RunId) -> Result<Vec<AttemptRecord>, RepoError> {
        use pipeline_run_attempts::dsl as pa;
        let mut conn = self.conn().await?;
        let rows: Vec<(
            i32,
            String,
            String,
            DateTime<Utc>,
            Option<DateTime<Utc>>,
            String,
            Option<String>,
        )> = pa::pipeline_run_attempts
            .filter(pa::run_id.eq(run_id.to_string()))
            .order(pa::attempt)
            .select((
                pa::attempt,
                pa::worker_id,
                pa::input_hash,
                pa::started_at,
                pa::finished_at,
                pa::outcome,
                pa::error,
            ))
            .load(&mut conn)
            .await
            .map_err(map_diesel_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(attempt, worker_id, input_hash, started_at, finished_at, outcome, error)| {
                    AttemptRecord {
                        attempt,
                        worker_id,
                        input_hash,
                        started_at,
                        finished_at,
                        outcome,
                        error,
                    }
                },
            )
            .collect())
    }
}

enum Recheck {
    Committed,
    NotCommitted,
    Fenced,
}

impl PgRunRepository {
    async fn complete_once(
        &self,
        token: &ClaimToken,
        write: &FencedWrite<'_>,
    ) -> Result<CompleteOutcome, StageError> {
        use pipeline_runs::dsl as pr;
        let mut conn = self.conn().await?;
        let outcome = conn
            .transaction::<_, TxError, _>(async move |conn| {
                {
                    crate::tenant::scope(conn, &token.tenant).await?;
                    // The fence first: it checks the token, marks success and locks the
                    // row, so a concurrent claim waits for this transaction and then
                    // sees `success`.
                    let fenced_rows = Cached(diesel::update(fenced(token)).set((
                        pr::status.eq("success"),
                        pr::finished_at.eq(now.into_sql::<Timestamptz>().nullable()),
                    )))
                    .execute(conn)
                    .await?;
                    if fenced_rows == 0 {
                        return Ok(CompleteOutcome::Fenced);
                    }
                    let mut tx = PgFencedTx::new(conn, token.clone());
                    write(&mut tx).await.map_err(TxError::Stage)?;
                    Ok(CompleteOutcome::Committed)
                }
            })
            .await;
        match outcome {
            Ok(CompleteOutcome::Fenced) => {
                drop(conn);
                self.record_fenced(token).await?;
                Ok(CompleteOutcome::Fenced)
            }
            Ok(o) => Ok(o),
            Err(e) => Err(e.into()),
        }
    }

    async fn recheck_after_lost_connection(
        &self,
        token: &ClaimToken,
    ) -> Result<Recheck, RepoError> {
        // The server may be restarting: give it a few seconds.
        let mut delay = Duration::from_millis(50);
        let mut last = None;
        for _ in 0..8 {
            let read = match self.conn().await {
                Ok(mut conn) => conn
                    .transaction::<_, TxError, _>(async |conn| {
                        crate::tenant::scope(conn, &token.tenant).await?;
                        Ok(read_run(
                            conn,
                            token.tenant.as_str(),
                            &token.anfrage.to_string(),
                            token.stage.as_str(),
                        )
                        .await?)
                    })
                    .await
                    .map_err(TxError::into_repo),
                Err(e) => Err(e),
            };
            match read {
                Ok(run) => {
                    return Ok(match run {
                        Some(r) if r.attempts == token.attempt && r.status == "success" => {
                            Recheck::Committed
                        }
                        Some(r) if r.attempts == token.attempt && r.status == "running" => {
                            Recheck::NotCommitted
                        }
                        _ => Recheck::Fenced,
                    });
                }
                // The pool may hand out a connection that died with the lost one
                // (a restart): it is dropped on return, and the next try gets another.
                Err(e @ RepoError::Unavailable(_)) => last = Some(e),
                Err(e) => return Err(e),
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
        Err(RepoError::AmbiguousCommit(format!(
            "could not re-read run {} after a lost connection: {}",
            token.run_id,
            last.map(|e| e.to_string()).unwrap_or_default()
        )))
    }
}

type FencedRows = diesel::helper_types::Filter<
    diesel::helper_types::Filter<
        diesel::helper_types::Filter<
            pipeline_runs::table,
            diesel::dsl::Eq<pipeline_runs::id, String>,
        >,
        diesel::dsl::Eq<pipeline_runs::attempts, i32>,
    >,
    diesel::dsl::Eq<pipeline_runs::status, &'static str>,
>;

/// Rows of `pipeline_runs` that the token still holds.
fn fenced(token: &ClaimToken) -> FencedRows {
    use pipeline_runs::dsl as pr;
    pr::pipeline_runs
        .filter(pr::id.eq(token.run_id.to_string()))
        .filter(pr::attempts.eq(token.attempt))
        .filter(pr::status.eq("running"))
}

async fn read_run(
    conn: &mut AsyncPgConnection,
    tenant: &str,
    anfrage: &str,
    stage: &str,
) -> Result<Option<RunRow>, RepoError> {
    use pipeline_runs::dsl as pr;
    pr::pipeline_runs
        .filter(pr::tenant_id.eq(tenant))
        .filter(pr::anfrage_id.eq(anfrage))
        .filter(pr::stage.eq(stage))
        .select(RunRow::as_select())
        .first(conn)
        .await
        .optional()
        .map_err(map_diesel_error)
}

/// Sets the outcome of the token's attempt row, if that attempt has not ended yet.
async fn mark_attempt(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
    outcome: &str,
) -> Result<(), RepoError> {
    use pipeline_run_attempts::dsl as pa;
    diesel::update(
        pa::pipeline_run_attempts
            .filter(pa::run_id.eq(token.run_id.to_string()))
            .filter(pa::attempt.eq(token.attempt))
            .filter(pa::outcome.eq_any(["running", "abandoned"])),
    )
    .set((
        pa::outcome.eq(outcome),
        pa::finished_at.eq(now.into_sql::<Timestamptz>().nullable()),
    ))
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    Ok(())
}

/// The claim returned no row: read the run and say why, or `None` if its state moved
/// on in between and the claim should be tried again.
async fn explain_skip(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, RepoError> {
    use pipeline_runs::dsl as pr;
    // The run and the database clock in one round trip.
    let found: Option<(RunRow, DateTime<Utc>)> = pr::pipeline_runs
        .filter(pr::tenant_id.eq(req.tenant.as_str()))
        .filter(pr::anfrage_id.eq(req.anfrage.to_string()))
        .filter(pr::stage.eq(req.stage.as_str()))
        .select((RunRow::as_select(), now.into_sql::<Timestamptz>()))
        .first(conn)
        .await
        .optional()
        .map_err(map_diesel_error)?;
    let Some((run, db_now)) = found else {
        return Ok(None);
    };
    let status: RunStatus = run.status.parse()?;
    Ok(match status {
        RunStatus::Success if run.input_hash == req.input_hash => {
            Some(ClaimOutcome::Skipped(SkipReason::AlreadySucceeded {
                run_id: RunId::parse(&run.id)?,
            }))
        }
        RunStatus::Success => match req.policy.on_input_change {
            InputChangePolicy::Reject => Some(ClaimOutcome::Rejected(RejectReason::InputChanged {
                stored_hash: run.input_hash,
                new_hash: req.input_hash.clone(),
            })),
            InputChangePolicy::Rerun => None,
        },
        RunStatus::Running if run.lease_expires_at >= db_now => {
            Some(ClaimOutcome::Skipped(SkipReason::InFlight {
                lease_expires_at: run.lease_expires_at,
            }))
        }
        RunStatus::Dead => Some(ClaimOutcome::Exhausted {
            attempts: run.attempts,
        }),
        _ if run.attempts >= run.max_attempts => {
            // Out of budget but not yet marked: mark it dead, conditionally on the
            // state just read, so a concurrent change wins.
            diesel::update(
                pr::pipeline_runs
                    .filter(pr::id.eq(&run.id))
                    .filter(pr::attempts.eq(run.attempts))
                    .filter(pr::status.eq(&run.status)),
            )
            .set((
                pr::status.eq("dead"),
                pr::last_error.eq("attempt budget used up (last lease expired)"),
            ))
            .execute(conn)
            .await
            .map_err(map_diesel_error)?;
            Some(ClaimOutcome::Exhausted {
                attempts: run.attempts,
            })
        }
        _ => None,
    })
}

fn truncate(error: &str) -> String {
    const MAX: usize = 4000;
    if error.len() <= MAX {
        return error.to_owned();
    }
    let mut end = MAX;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &error[..end], error.len())
}
