//! The lease's other ends, fenced on the token: renew, fail, release, an
//! interruption (released, or counted past its bound), and the `fenced` mark in
//! the attempt history.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Bool, Integer, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    sanitize_error_text, ClaimToken, FailOutcome, RenewOutcome, RepoError, TenantId,
};

use crate::cached::CachedExt;
use crate::error::{map_diesel_error, TxError};

use super::{micros, sql, PgRunRepository};

impl PgRunRepository {
    /// Extends the lease to `lease` from now (database clock), if the token still
    /// holds; a lease that ran out can be renewed while no other claim took the
    /// run. `Fenced`: nothing changed, and the attempt can no longer commit.
    pub async fn renew_lease(
        &self,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<RenewOutcome, RepoError> {
        let mut conn = self.conn().await?;
        let renewed: Option<LeaseRow> = crate::tenant::transaction::<_, diesel::result::Error, _>(
            &mut conn,
            &token.tenant,
            async |conn| {
                diesel::sql_query(sql::RENEW)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<BigInt, _>(micros(lease))
                    .cached()
                    .get_result(conn)
                    .await
                    .optional()
            },
        )
        .await
        .map_err(map_diesel_error)?;
        Ok(lease_outcome(renewed))
    }

    /// Records a failed attempt (fenced on the token). A permanent failure, or the
    /// last attempt of the budget, makes the run `dead`.
    ///
    /// `retryable: false` is the permanent failure (`Exhausted` at once); otherwise
    /// `WillRetry` (the run is `failed`, claimable again) or `Exhausted`.
    /// `Fenced`: nothing was recorded. `error` is sanitised before it is stored.
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
        let failed: Option<Failed> = crate::tenant::transaction::<_, diesel::result::Error, _>(
            &mut conn,
            &token.tenant,
            async |conn| {
                diesel::sql_query(sql::FAIL)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<Text, _>(&error)
                    .bind::<Bool, _>(retryable)
                    .cached()
                    .get_result(conn)
                    .await
                    .optional()
            },
        )
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

    /// Holds the bucket of `queue` for `tenant` (see [`crate::queue::hold`]) for
    /// `after`: what a stage's [`StageError::RateLimited`] does after its claim is
    /// released.
    ///
    /// [`StageError::RateLimited`]: idemstage_domain::StageError::RateLimited
    pub async fn hold(
        &self,
        queue: &str,
        tenant: &TenantId,
        after: std::time::Duration,
    ) -> Result<(), RepoError> {
        let mut conn = self.conn().await?;
        crate::queue::hold(&mut conn, queue, Some(tenant), after).await
    }

    /// Gives the lease back without counting the attempt (a shutdown, a database
    /// error that interrupted the attempt); `reason` is recorded as `last_error`.
    ///
    /// The run stays `running` with its lease ended now, claimable at once, and its
    /// budget grows by one; the attempt is `abandoned` in the history. Success is
    /// reported as `RenewOutcome::Renewed` with the lease's new end (now): the
    /// release, not a renewal. `Fenced`: the token no longer holds and the run was
    /// left as it is.
    pub async fn release(
        &self,
        token: &ClaimToken,
        reason: &str,
    ) -> Result<RenewOutcome, RepoError> {
        let mut conn = self.conn().await?;
        let reason = sanitize_error_text(reason);
        // The attempt row says `abandoned`: the attempt did not fail, it was given up.
        let released: Option<LeaseRow> =
            crate::tenant::transaction::<_, TxError, _>(&mut conn, &token.tenant, async |conn| {
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

    /// Gives back an attempt that a retryable database error interrupted, fenced
    /// on the token, unless `max_interruptions` attempts in a row before it were
    /// given back already: then it counts as a failed, retryable attempt
    /// (`failed`, or `dead` with the budget used up), its `error` recorded in
    /// `last_error` and the attempt history. Released, it is `abandoned` in the
    /// history with the run claimable at once, as [`release`](Self::release)
    /// leaves it. `error` is sanitised before it is stored.
    pub async fn interrupt(
        &self,
        token: &ClaimToken,
        error: &str,
        max_interruptions: i32,
    ) -> Result<InterruptOutcome, RepoError> {
        #[derive(QueryableByName)]
        struct Interrupted {
            #[diesel(sql_type = Text)]
            status: String,
            #[diesel(sql_type = Integer)]
            attempts: i32,
            #[diesel(sql_type = Integer)]
            in_row: i32,
        }
        let mut conn = self.conn().await?;
        let released_reason = sanitize_error_text(&format!("interrupted, not counted: {error}"));
        let counted_reason = sanitize_error_text(&format!(
            "{error} (counted after {max_interruptions} interruptions in a row given back uncounted)"
        ));
        let row: Option<Interrupted> =
            crate::tenant::transaction::<_, TxError, _>(&mut conn, &token.tenant, async |conn| {
                let row: Option<Interrupted> = diesel::sql_query(sql::INTERRUPT)
                    .bind::<Text, _>(token.run_id.to_string())
                    .bind::<Integer, _>(token.attempt)
                    .bind::<Text, _>(&released_reason)
                    .bind::<Integer, _>(max_interruptions)
                    .bind::<Text, _>(&counted_reason)
                    .cached()
                    .get_result(conn)
                    .await
                    .optional()?;
                // Counted, the attempt trigger has recorded it `failed` already.
                if row.as_ref().is_some_and(|r| r.status == "running") {
                    mark_attempt(conn, token, "abandoned").await?;
                }
                Ok(row)
            })
            .await
            .map_err(TxError::into_repo)?;
        Ok(match row {
            None => InterruptOutcome::Fenced,
            Some(r) if r.status == "running" => InterruptOutcome::Released {
                in_row: r.in_row + 1,
            },
            Some(r) => InterruptOutcome::Counted {
                attempt: r.attempts,
                dead: r.status == "dead",
            },
        })
    }

    /// Marks the token's attempt `fenced` in the history (it lost its lease), if
    /// the attempt is still `running` or `abandoned` there. [`complete`] does this
    /// itself when its transaction finds the token gone.
    ///
    /// [`complete`]: PgRunRepository::complete
    pub async fn record_fenced(&self, token: &ClaimToken) -> Result<(), RepoError> {
        let mut conn = self.conn().await?;
        crate::tenant::transaction::<_, TxError, _>(&mut conn, &token.tenant, async |conn| {
            Ok(mark_attempt(conn, token, "fenced").await?)
        })
        .await
        .map_err(TxError::into_repo)
    }
}

/// What [`PgRunRepository::interrupt`] did with an interrupted attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterruptOutcome {
    /// Given back uncounted, the `in_row`-th interrupted attempt in a row.
    Released {
        /// Interrupted attempts in a row given back, this one included.
        in_row: i32,
    },
    /// One interruption too many in a row: counted as a failed attempt.
    Counted {
        /// The attempt that counted.
        attempt: i32,
        /// The run is `dead`: that was the last attempt of its budget.
        dead: bool,
    },
    /// The token no longer holds; nothing was recorded.
    Fenced,
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

/// Records how the token's attempt ended, if it has not ended yet
/// ([`sql::END_ATTEMPT`]); an attempt recorded `abandoned` that comes back to
/// find its token gone is named `fenced` ([`sql::FENCE_ABANDONED`]).
async fn mark_attempt(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
    outcome: &str,
) -> Result<(), RepoError> {
    let statements: &[&str] = if outcome == "abandoned" {
        &[sql::END_ATTEMPT]
    } else {
        &[sql::FENCE_ABANDONED, sql::END_ATTEMPT]
    };
    for statement in statements {
        diesel::sql_query(*statement)
            .bind::<Text, _>(token.run_id.to_string())
            .bind::<Integer, _>(token.attempt)
            .bind::<Text, _>(outcome)
            .cached()
            .execute(conn)
            .await
            .map_err(map_diesel_error)?;
    }
    Ok(())
}
