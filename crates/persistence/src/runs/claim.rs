//! The claim: one atomic statement, and when it returns no row, the read that says why.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    ClaimOutcome, ClaimRequest, InputChangePolicy, RejectReason, RepoError, RunId, RunStatus,
    SkipReason,
};

use crate::cached::CachedExt;
use crate::error::{map_diesel_error, TxError};

use super::{conflict_backoff, micros, sql, PgRunRepository, CONFLICT_RETRIES};

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
        .bind::<Text, _>(req.item.to_string())
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
            if info.constraint_name() == Some("stage_runs_item_fk") =>
        {
            RepoError::ItemNotFound {
                tenant: req.tenant.to_string(),
                item: req.item.to_string(),
            }
        }
        _ => map_diesel_error(e),
    }
}

/// What one round of [`PgRunRepository::claim`] found.
enum Round {
    Claimed(ClaimedRow),
    Explained(ClaimOutcome),
    /// The state moved on between the claim and its explanation: again.
    Again,
}

/// One claim, in a transaction scoped to the request's tenant (row-level
/// security); when it returns no row, the read that says why, in the same
/// transaction (one transaction for a skip, not two).
async fn claim_once(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
    gather: bool,
) -> Result<Round, RepoError> {
    crate::tenant::transaction::<_, TxError, _>(conn, &req.tenant, async move |conn| {
        if let (true, Some(upstream)) = (gather, &req.upstream) {
            if let Some(waiting) = gather_waits(conn, req, upstream).await? {
                return Ok(Round::Explained(waiting));
            }
        }
        let claimed = claim_statement(conn, req)
            .await
            .map_err(|e| TxError::Repo(map_claim_error(e, req)))?;
        if let Some(row) = claimed {
            return Ok(Round::Claimed(row));
        }
        Ok(match explain_skip(conn, req).await? {
            Some(outcome) => Round::Explained(outcome),
            None => Round::Again,
        })
    })
    .await
    .map_err(TxError::into_repo)
}

/// A gather's fan-out with children not yet final: `ChildrenNotFinal`. Its
/// count only grows (a rerun of the parent writes another fan-out, which this
/// claim's source then is), so a gather found ready here stays ready.
async fn gather_waits(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
    upstream: &idemstage_domain::StageName,
) -> Result<Option<ClaimOutcome>, RepoError> {
    #[derive(QueryableByName)]
    struct Ready {
        #[diesel(sql_type = Integer)]
        final_children: i32,
        #[diesel(sql_type = Integer)]
        children: i32,
    }
    let ready: Option<Ready> = diesel::sql_query(sql::GATHER_READY)
        .bind::<Text, _>(req.tenant.as_str())
        .bind::<Text, _>(req.item.to_string())
        .bind::<Text, _>(upstream.as_str())
        .cached()
        .get_result(conn)
        .await
        .optional()
        .map_err(map_diesel_error)?;
    Ok(ready.filter(|r| r.final_children < r.children).map(|r| {
        ClaimOutcome::Skipped(SkipReason::ChildrenNotFinal {
            final_children: r.final_children,
            children: r.children,
        })
    }))
}

impl PgRunRepository {
    /// As [`claim`](Self::claim), for a gather stage: refused with
    /// `Skipped(ChildrenNotFinal)` (no attempt used) while a child of the
    /// fan-out it would bind is not final.
    pub async fn claim_gather(&self, req: &ClaimRequest) -> Result<ClaimOutcome, RepoError> {
        self.claim_as(req, true).await
    }

    /// The one atomic claim statement (plus a read when it returns no row, to say
    /// why), in one transaction scoped to `req.tenant`.
    ///
    /// Only `Claimed` hands out a fencing token (`attempt`); `Skipped`, `Rejected`
    /// and `Exhausted` run nothing (see [`ClaimOutcome`]); finding the budget used
    /// up can mark the run `dead` on the way. An invalid policy is `Invalid` before
    /// anything runs, a missing item `ItemNotFound`. Serialization failures,
    /// deadlocks and a state that changes between the claim and the read are
    /// retried within three rounds in all; after that the result is `Conflict`
    /// (retryable).
    pub async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, RepoError> {
        self.claim_as(req, false).await
    }

    async fn claim_as(&self, req: &ClaimRequest, gather: bool) -> Result<ClaimOutcome, RepoError> {
        req.policy.validate()?;
        let mut conn = self.conn().await?;
        // The guard can say no because of a state that changes right after (a lease
        // that just ran out); a few rounds of claim-then-explain settle it.
        let mut conflicts = 0;
        for _ in 0..3 {
            match claim_once(&mut conn, req, gather).await {
                Err(RepoError::Conflict(msg)) if conflicts < CONFLICT_RETRIES => {
                    conflicts += 1;
                    conflict_backoff(conflicts, &msg).await;
                }
                Err(e) => return Err(e),
                Ok(Round::Claimed(row)) => {
                    return Ok(ClaimOutcome::Claimed {
                        run_id: RunId::parse(&row.id)?,
                        attempt: row.attempts,
                        lease_expires_at: row.lease_expires_at,
                        input_hash: row.input_hash,
                        upstream_attempt: row.upstream_attempt,
                    });
                }
                Ok(Round::Explained(outcome)) => return Ok(outcome),
                Ok(Round::Again) => {}
            }
        }
        Err(RepoError::Conflict(
            format!(
                "claim of {}/{}/{} kept changing state",
                req.tenant, req.item, req.stage
            )
            .into(),
        ))
    }
}

/// The row of `sql::EXPLAIN_SKIP`.
#[derive(QueryableByName)]
struct Explained {
    #[diesel(sql_type = Timestamptz)]
    db_now: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Text>)]
    stored_hash: Option<String>,
    #[diesel(sql_type = Nullable<Bool>)]
    superseded: Option<bool>,
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
    #[diesel(sql_type = Nullable<Text>)]
    success_hash: Option<String>,
    #[diesel(sql_type = Nullable<Integer>)]
    success_upstream: Option<i32>,
}

/// The claim returned no row: read the source and the run and say why, or `None`
/// if their state moved on in between and the claim should be tried again.
async fn explain_skip(
    conn: &mut AsyncPgConnection,
    req: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, RepoError> {
    let e: Explained = diesel::sql_query(sql::EXPLAIN_SKIP)
        .bind::<Text, _>(req.tenant.as_str())
        .bind::<Text, _>(req.item.to_string())
        .bind::<Text, _>(req.stage.as_str())
        .bind::<Nullable<Text>, _>(req.upstream.as_ref().map(|s| s.as_str()))
        .cached()
        .get_result(conn)
        .await
        .map_err(map_diesel_error)?;
    // The source first: without it the claim inserted nothing and looked at no row.
    let Some(stored_hash) = e.stored_hash else {
        return Err(RepoError::ItemNotFound {
            tenant: req.tenant.to_string(),
            item: req.item.to_string(),
        });
    };
    if e.superseded == Some(true) {
        return Ok(Some(ClaimOutcome::Skipped(SkipReason::Superseded)));
    }
    // The upstream attempt a claim would bind now (none for the first stage).
    let bound_upstream = req.upstream.as_ref().and(e.upstream_success);
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
    // Its current success is what this claim would compute: restore it, never run it
    // again (a second success on the same input). A live lease is still InFlight.
    let held = status == RunStatus::Running && lease >= e.db_now;
    let restorable = matches!(
        status,
        RunStatus::Failed | RunStatus::Dead | RunStatus::Stale | RunStatus::Running
    );
    if restorable
        && !held
        && e.success_hash.as_deref() == Some(bound_hash.as_str())
        && e.success_upstream == bound_upstream
    {
        let restored = diesel::sql_query(sql::RESTORE_SUCCESS)
            .bind::<Text, _>(&run_id)
            .bind::<Integer, _>(attempts)
            .cached()
            .execute(conn)
            .await
            .map_err(map_diesel_error)?;
        let run_id = RunId::parse(&run_id)?;
        return Ok((restored == 1).then_some(ClaimOutcome::Skipped(
            SkipReason::AlreadySucceeded { run_id },
        )));
    }
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
        RunStatus::Cancelled => Some(ClaimOutcome::Skipped(SkipReason::Cancelled {
            run_id: RunId::parse(&run_id)?,
        })),
        RunStatus::Waiting => Some(ClaimOutcome::Skipped(SkipReason::Waiting {
            run_id: RunId::parse(&run_id)?,
        })),
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
