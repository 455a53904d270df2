//! Layer 1: the claim repository on `pipeline_runs`. The statements are in `sql`.

pub mod sql;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::dsl::now;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    sanitize_error_text, AnfrageId, AttemptRecord, ClaimOutcome, ClaimRequest, ClaimToken,
    CompleteOutcome, FailOutcome, InputChangePolicy, RejectReason, RenewOutcome, RepoError, RunId,
    RunRecord, RunStatus, SkipReason, StageError, StageName, TenantId,
};

use crate::cached::CachedExt;
use crate::error::{map_diesel_error, TxError};
use crate::fenced::{FencedTx, FencedWrite};
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
    success_attempt: Option<i32>,
    upstream_stage: Option<String>,
    upstream_attempt: Option<i32>,
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
            success_attempt: self.success_attempt,
            upstream_stage: self
                .upstream_stage
                .as_deref()
                .map(StageName::parse)
                .transpose()?,
            upstream_attempt: self.upstream_attempt,
        })
    }
}

/// A duration in microseconds, the unit the statements take leases in.
fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[derive(QueryableByName)]
struct ClaimedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Timestamptz)]
    lease_expires_at: DateTime<Utc>,
    #[diesel(sql_type = Text)]
    input_hash: String,
    #[diesel(sql_type = Nullable<Integer>)]
    upstream_attempt: Option<i32>,
}

/// The claim statement (`sql::CLAIM`).
async fn claim_statement(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<Option<ClaimedRow>, diesel::result::Error> {
    diesel::sql_query(sql::CLAIM)
        .bind::<Text, _>(RunId::new().to_string())
        .bind::<Text, _>(req.tenant.as_str())
        .bind::<Text, _>(req.anfrage.to_string())
        .bind::<Text, _>(req.stage.as_str())
        .bind::<Integer, _>(req.policy.max_attempts)
        .bind::<Text, _>(&req.input_hash)
        .bind::<Text, _>(req.worker.as_str())
        .bind::<BigInt, _>(micros(req.policy.lease))
        // A bound flag, not SQL text: one prepared statement serves both policies.
        .bind::<Bool, _>(req.policy.on_input_change == InputChangePolicy::Rerun)
        .bind::<Nullable<Text>, _>(req.upstream.as_ref().map(|s| s.as_str()))
        .cached()
        .get_result(conn)
        .await
        .optional()
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

/// One claim, in a transaction scoped to the request's tenant (row-level security).
async fn claim_once(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<Option<ClaimedRow>, RepoError> {
    conn.transaction::<_, diesel::result::Error, _>(async move |conn| {
        crate::tenant::scope(conn, &req.tenant).await?;
        claim_statement(conn, req).await
    })
    .await
    .map_err(|e| map_claim_error(e, req))
}

impl PgRunRepository {
    /// The one atomic claim statement (plus a read when it returns no row, to say
    /// why).
    pub async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, RepoError> {
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
            if let Some(row) = claimed {
                return Ok(ClaimOutcome::Claimed {
                    run_id: RunId::parse(&row.id)?,
                    attempt: row.attempts,
                    lease_expires_at: row.lease_expires_at,
                    input_hash: row.input_hash,
                    upstream_attempt: row.upstream_attempt,
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

    /// Extends the lease from the database clock, if the token still holds.
    pub async fn renew_lease(
        &self,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<RenewOutcome, RepoError> {
        let mut conn = self.conn().await?;
        let renewed: Option<LeaseRow> = conn
            .transaction::<_, diesel::result::Error, _>(async |conn| {
                crate::tenant::scope(conn, &token.tenant).await?;
                diesel::sql_query(sql::RENEW)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<BigInt, _>(micros(lease))
                    .cached()
                    .get_result(conn)
                    .await
                    .optional()
            })
            .await
            .map_err(map_diesel_error)?;
        Ok(lease_outcome(renewed))
    }

    /// Checks lineage and the token, marks the run `success`, runs `write`, commits:
    /// all one transaction. Retries 40001/40P01; re-reads the run after an
    /// ambiguous commit.
    pub async fn complete(
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

    /// Records a failed attempt (fenced on the token). A permanent failure, or the
    /// last attempt of the budget, makes the run `dead`.
    pub async fn fail(
        &self,
        token: &ClaimToken,
        error: &str,
        retryable: bool,
    ) -> Result<FailOutcome, RepoError> {
        #[derive(QueryableByName)]
        struct Failed {
            #[diesel(sql_type = Text)]
            status: String,
            #[diesel(sql_type = Integer)]
            attempts: i32,
        }
        let mut conn = self.conn().await?;
        // Sanitised: recording a failure must not fail on the failure's own text.
        let error = sanitize_error_text(error);
        let failed: Option<Failed> = conn
            .transaction::<_, diesel::result::Error, _>(async |conn| {
                crate::tenant::scope(conn, &token.tenant).await?;
                diesel::sql_query(sql::FAIL)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<Text, _>(&error)
                    .bind::<Bool, _>(retryable)
                    .cached()
                    .get_result(conn)
                    .await
                    .optional()
            })
            .await
            .map_err(map_diesel_error)?;
        Ok(match failed {
            Some(f) if f.status == "dead" => FailOutcome::Exhausted {
                attempts: f.attempts,
            },
            Some(f) => FailOutcome::WillRetry {
                attempt: f.attempts,
            },
            None => FailOutcome::Fenced,
        })
    }

    /// Gives the lease back without counting the attempt (a shutdown, a database
    /// error that interrupted the attempt); `reason` is recorded as `last_error`.
    pub async fn release(
        &self,
        token: &ClaimToken,
        reason: &str,
    ) -> Result<RenewOutcome, RepoError> {
        let mut conn = self.conn().await?;
        let reason = sanitize_error_text(reason);
        // The attempt row says `abandoned`: the attempt did not fail, it was given up.
        let released: Option<LeaseRow> = conn
            .transaction::<_, TxError, _>(async |conn| {
                crate::tenant::scope(conn, &token.tenant).await?;
                let released = diesel::sql_query(sql::RELEASE)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<Text, _>(&reason)
                    .cached()
                    .get_result(conn)
                    .await
                    .optional()?;
                mark_attempt(conn, token, "abandoned").await?;
                Ok(released)
            })
            .await
            .map_err(TxError::into_repo)?;
        Ok(lease_outcome(released))
    }

    /// Marks the token's attempt `fenced` in the history (it lost its lease).
    pub async fn record_fenced(&self, token: &ClaimToken) -> Result<(), RepoError> {
        let mut conn = self.conn().await?;
        conn.transaction::<_, TxError, _>(async |conn| {
            crate::tenant::scope(conn, &token.tenant).await?;
            Ok(mark_attempt(conn, token, "fenced").await?)
        })
        .await
        .map_err(TxError::into_repo)
    }

    /// The run of (tenant, anfrage, stage), if any.
    pub async fn read_run(
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

    /// Every attempt of a run, in order.
    pub async fn attempt_history(&self, run_id: &RunId) -> Result<Vec<AttemptRecord>, RepoError> {
        use pipeline_run_attempts::dsl as pa;
        type Row = (
            i32,
            String,
            String,
            DateTime<Utc>,
            Option<DateTime<Utc>>,
            String,
            Option<String>,
            Option<i32>,
        );
        let mut conn = self.conn().await?;
        let rows: Vec<Row> = pa::pipeline_run_attempts
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
                pa::upstream_attempt,
            ))
            .load(&mut conn)
            .await
            .map_err(map_diesel_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(
                    attempt,
                    worker_id,
                    input_hash,
                    started_at,
                    finished_at,
                    outcome,
                    error,
                    upstream_attempt,
                )| AttemptRecord {
                    attempt,
                    worker_id,
                    input_hash,
                    started_at,
                    finished_at,
                    outcome,
                    error,
                    upstream_attempt,
                },
            )
            .collect())
    }
}

#[derive(QueryableByName)]
struct LeaseRow {
    #[diesel(sql_type = Timestamptz)]
    lease_expires_at: DateTime<Utc>,
}

/// A fenced lease statement's row (the new lease end), or none: the token lost.
fn lease_outcome(row: Option<LeaseRow>) -> RenewOutcome {
    match row {
        Some(row) => RenewOutcome::Renewed {
            lease_expires_at: row.lease_expires_at,
        },
        None => RenewOutcome::Fenced,
    }
}

enum Recheck {
    Committed,
    NotCommitted,
    Fenced,
}

/// What the lineage check found.
enum Lineage {
    Current,
    Changed,
    /// The token no longer holds.
    Fenced,
}

async fn check_lineage(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
) -> Result<Lineage, diesel::result::Error> {
    #[derive(QueryableByName)]
    struct Current {
        #[diesel(sql_type = Bool)]
        current: bool,
    }
    let found: Option<Current> = diesel::sql_query(sql::LINEAGE_CURRENT)
        .bind::<Text, _>(token.run_id.to_string())
        .bind::<Integer, _>(token.attempt)
        .cached()
        .get_result(conn)
        .await
        .optional()?;
    Ok(match found {
        Some(Current { current: true }) => Lineage::Current,
        Some(Current { current: false }) => Lineage::Changed,
        None => Lineage::Fenced,
    })
}

impl PgRunRepository {
    async fn complete_once(
        &self,
        token: &ClaimToken,
        write: &FencedWrite<'_>,
    ) -> Result<CompleteOutcome, StageError> {
        let mut conn = self.conn().await?;
        let outcome = conn
            .transaction::<_, TxError, _>(async move |conn| {
                crate::tenant::scope(conn, &token.tenant).await?;
                // Lineage first (it share-locks the upstream row or the anfrage):
                // the input this attempt read must still be current.
                match check_lineage(conn, token).await? {
                    Lineage::Current => {}
                    Lineage::Fenced => return Ok(CompleteOutcome::Fenced),
                    Lineage::Changed => {
                        // Nothing of the stage is written; the run becomes `stale`
                        // (claimable again, on the new upstream) in this transaction.
                        diesel::sql_query(sql::STALE_ON_LINEAGE)
                            .bind::<Text, _>(token.run_id.to_string())
                            .bind::<Integer, _>(token.attempt)
                            .bind::<Text, _>(
                                "the input this attempt read changed before it committed",
                            )
                            .cached()
                            .execute(conn)
                            .await?;
                        return Ok(CompleteOutcome::UpstreamChanged);
                    }
                }
                // The fence: it checks the token, marks success and locks the row,
                // so a concurrent claim waits for this transaction and then sees
                // `success`.
                let fenced_rows = diesel::sql_query(sql::FENCE_SUCCESS)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .cached()
                    .execute(conn)
                    .await?;
                if fenced_rows == 0 {
                    return Ok(CompleteOutcome::Fenced);
                }
                // A first attempt cannot have succeeded before, so nothing was
                // computed from an earlier success of it.
                if token.attempt > 1 {
                    diesel::sql_query(sql::INVALIDATE_DOWNSTREAM)
                        .bind::<Text, _>(token.tenant.as_str())
                        .bind::<Text, _>(token.anfrage.to_string())
                        .bind::<Text, _>(token.stage.as_str())
                        .bind::<Text, _>(format!(
                            "upstream stage {} succeeded again (attempt {})",
                            token.stage, token.attempt
                        ))
                        .cached()
                        .execute(conn)
                        .await?;
                }
                let mut tx = FencedTx::new(conn, token.clone());
                write(&mut tx).await.map_err(TxError::Stage)?;
                Ok(CompleteOutcome::Committed)
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

/// The row of `sql::EXPLAIN_SKIP`.
#[derive(QueryableByName)]
struct Explained {
    #[diesel(sql_type = Timestamptz)]
    db_now: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Text>)]
    stored_hash: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    upstream_status: Option<String>,
    #[diesel(sql_type = Nullable<Integer>)]
    upstream_success: Option<i32>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    upstream_lease: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    upstream_hash: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    run_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    status: Option<String>,
    #[diesel(sql_type = Nullable<Integer>)]
    attempts: Option<i32>,
    #[diesel(sql_type = Nullable<Integer>)]
    max_attempts: Option<i32>,
    #[diesel(sql_type = Nullable<Text>)]
    input_hash: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    lease_expires_at: Option<DateTime<Utc>>,
}

/// The claim returned no row: read the source and the run and say why, or `None`
/// if their state moved on in between and the claim should be tried again.
async fn explain_skip(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, RepoError> {
    let e: Explained = diesel::sql_query(sql::EXPLAIN_SKIP)
        .bind::<Text, _>(req.tenant.as_str())
        .bind::<Text, _>(req.anfrage.to_string())
        .bind::<Text, _>(req.stage.as_str())
        .bind::<Nullable<Text>, _>(req.upstream.as_ref().map(|s| s.as_str()))
        .cached()
        .get_result(conn)
        .await
        .map_err(map_diesel_error)?;
    // The source first: without it the claim inserted nothing and looked at no row.
    let Some(stored_hash) = e.stored_hash else {
        return Err(RepoError::AnfrageNotFound {
            tenant: req.tenant.to_string(),
            anfrage: req.anfrage.to_string(),
        });
    };
    let bound_hash = match &req.upstream {
        None if stored_hash != req.input_hash => {
            return Ok(Some(ClaimOutcome::Rejected(RejectReason::InputMismatch {
                job_hash: req.input_hash.clone(),
                stored_hash,
            })))
        }
        None => stored_hash,
        Some(upstream) => match (e.upstream_success, e.upstream_hash) {
            (Some(_), Some(hash)) => hash,
            _ => {
                let status = e.upstream_status.as_deref().map(str::parse).transpose()?;
                return Ok(Some(ClaimOutcome::Skipped(SkipReason::UpstreamNotDone {
                    upstream: upstream.clone(),
                    lease_expires_at: match status {
                        Some(RunStatus::Running) => e.upstream_lease,
                        _ => None,
                    },
                    status,
                })));
            }
        },
    };
    let (Some(run_id), Some(status), Some(attempts), Some(max_attempts), Some(hash), Some(lease)) = (
        e.run_id,
        e.status,
        e.attempts,
        e.max_attempts,
        e.input_hash,
        e.lease_expires_at,
    ) else {
        // The source is there but no run: it appeared (or the claim raced). Again.
        return Ok(None);
    };
    let status: RunStatus = status.parse()?;
    Ok(match status {
        RunStatus::Success if hash == bound_hash => {
            Some(ClaimOutcome::Skipped(SkipReason::AlreadySucceeded {
                run_id: RunId::parse(&run_id)?,
            }))
        }
        RunStatus::Success => match req.policy.on_input_change {
            InputChangePolicy::Reject => Some(ClaimOutcome::Rejected(RejectReason::InputChanged {
                stored_hash: hash,
                new_hash: bound_hash,
            })),
            InputChangePolicy::Rerun => None,
        },
        RunStatus::Running if lease >= e.db_now => {
            Some(ClaimOutcome::Skipped(SkipReason::InFlight {
                lease_expires_at: lease,
            }))
        }
        RunStatus::Dead => Some(ClaimOutcome::Exhausted { attempts }),
        RunStatus::Failed | RunStatus::Running if attempts >= max_attempts => {
            // Out of budget but not yet marked: mark it dead, if it is still in a
            // state the guard refused for that reason (a concurrent release or
            // claim wins; then look again).
            let marked = diesel::sql_query(sql::MARK_EXHAUSTED)
                .bind::<Text, _>(&run_id)
                .cached()
                .execute(conn)
                .await
                .map_err(map_diesel_error)?;
            (marked == 1).then_some(ClaimOutcome::Exhausted { attempts })
        }
        _ => None,
    })
}
