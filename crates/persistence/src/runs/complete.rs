//! The fenced completion: lineage check, fence, downstream invalidation and the
//! stage's writes in one transaction, and the re-check after a lost connection.

use std::time::Duration;

use diesel::prelude::*;
use diesel::sql_types::{Bool, Integer, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ClaimToken, CompleteOutcome, RepoError, StageError};

use crate::cached::CachedExt;
use crate::error::TxError;
use crate::fenced::{FencedTx, FencedWrite};

use super::read::read_run_row;
use super::{conflict_backoff, sql, PgRunRepository, CONFLICT_RETRIES};

impl PgRunRepository {
    /// Checks lineage and the token, marks the run `success`, runs `write`, commits:
    /// all one transaction. Retries 40001/40P01; re-reads the run after an
    /// ambiguous commit.
    ///
    /// The transaction is scoped to the token's tenant. `Committed`: the run's
    /// success and everything `write` did are committed. `Fenced`: the token no
    /// longer holds and nothing was written. `UpstreamChanged`: the input this
    /// attempt read is no longer current; nothing of the stage was written and the
    /// run is `stale`. An expired lease alone does not fence; another claim or the
    /// run going `stale` does.
    ///
    /// An error of `write` rolls everything back and is returned as it is, except
    /// `StageError::Repo(Conflict)` (the transaction is run again) and
    /// `StageError::Repo(Unavailable)` (the run is re-read, as after a lost
    /// COMMIT). So `write` may run several times; only the last run's writes
    /// commit. A lost connection that the re-read cannot settle ends in
    /// `Unavailable` or `AmbiguousCommit`, both retryable.
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

    async fn complete_once(
        &self,
        token: &ClaimToken,
        write: &FencedWrite<'_>,
    ) -> Result<CompleteOutcome, StageError> {
        let mut conn = self.conn().await?;
        let wake = self.wake();
        let outcome = crate::tenant::transaction::<_, TxError, _>(
            &mut conn,
            &token.tenant,
            async move |conn| {
                // Lineage first (it share-locks the upstream row or the item):
                // the input this attempt read must still be current. Then the
                // fence: it checks the token, marks success and locks the row, so
                // a concurrent claim waits for this transaction and then sees
                // `success`. The two are sent together (one round trip; the server
                // runs them in this order), so the fence runs before its answer is
                // known: an upstream that changed rolls the fence back below.
                let (lineage, fenced_rows) = {
                    let pipelined: &AsyncPgConnection = conn;
                    futures_util::try_join!(
                        check_lineage(pipelined, token),
                        fence(pipelined, token)
                    )?
                };
                match (lineage, fenced_rows) {
                    (Lineage::Current, 1..) => {}
                    (Lineage::Fenced, _) | (_, 0) => {
                        return Ok((CompleteOutcome::Fenced, Vec::new()))
                    }
                    // Nothing of the stage may be written, and this transaction
                    // has marked it `success`: roll it back, then mark it `stale`.
                    (Lineage::Changed, _) => {
                        return Err(TxError::Diesel(diesel::result::Error::RollbackTransaction))
                    }
                }
                // A first attempt cannot have succeeded before, so nothing was
                // computed from an earlier success of it.
                if token.attempt > 1 {
                    diesel::sql_query(sql::INVALIDATE_DOWNSTREAM)
                        .bind::<Text, _>(token.tenant.as_str())
                        .bind::<Text, _>(token.item.to_string())
                        .bind::<Text, _>(token.stage.as_str())
                        .bind::<Text, _>(format!(
                            "upstream stage {} succeeded again (attempt {})",
                            token.stage, token.attempt
                        ))
                        .cached()
                        .execute(conn)
                        .await?;
                }
                let mut tx = FencedTx::new(conn, token.clone(), wake);
                write(&mut tx).await.map_err(TxError::Stage)?;
                Ok((CompleteOutcome::Committed, tx.into_to_wake()))
            },
        )
        .await;
        match outcome {
            Err(TxError::Diesel(diesel::result::Error::RollbackTransaction)) => {
                drop(conn);
                self.stale_on_lineage(token).await
            }
            Ok((CompleteOutcome::Fenced, _)) => {
                drop(conn);
                self.record_fenced(token).await?;
                Ok(CompleteOutcome::Fenced)
            }
            Ok((CompleteOutcome::Committed, to_wake)) => {
                // After a lost COMMIT that the re-read finds committed, nothing is
                // woken here: the workers' poll finds those jobs.
                if let Some(notifier) = &self.notifier {
                    for queue in &to_wake {
                        notifier.notify(queue);
                    }
                }
                Ok(CompleteOutcome::Committed)
            }
            Ok((o, _)) => Ok(o),
            Err(e) => Err(e.into()),
        }
    }

    /// After the fenced transaction found the upstream changed and rolled back (or
    /// an attempt found its bound upstream output gone before it prepared):
    /// the run becomes `stale` (claimable again, on the new upstream), fenced on
    /// the token, with the lineage checked again in this transaction. An upstream
    /// current again by now (an input replaced and then put back) is a `Conflict`:
    /// [`complete`](Self::complete) runs the attempt's transaction again.
    pub async fn stale_on_lineage(
        &self,
        token: &ClaimToken,
    ) -> Result<CompleteOutcome, StageError> {
        let mut conn = self.conn().await?;
        crate::tenant::transaction::<_, TxError, _>(&mut conn, &token.tenant, async |conn| {
            match check_lineage(conn, token).await? {
                Lineage::Fenced => Ok(CompleteOutcome::Fenced),
                Lineage::Current => Err(TxError::Repo(RepoError::Conflict(
                    "the upstream became current again while the attempt was rolled back".into(),
                ))),
                Lineage::Changed => {
                    diesel::sql_query(sql::STALE_ON_LINEAGE)
                        .bind::<Text, _>(token.run_id.to_string())
                        .bind::<Integer, _>(token.attempt)
                        .bind::<Text, _>("the input this attempt read changed before it committed")
                        .cached()
                        .execute(conn)
                        .await?;
                    Ok(CompleteOutcome::UpstreamChanged)
                }
            }
        })
        .await
        .map_err(StageError::from)
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
                Ok(mut conn) => crate::tenant::transaction::<_, TxError, _>(
                    &mut conn,
                    &token.tenant,
                    async |conn| {
                        Ok(read_run_row(
                            conn,
                            token.tenant.as_str(),
                            &token.item.to_string(),
                            token.stage.as_str(),
                        )
                        .await?)
                    },
                )
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
        Err(RepoError::AmbiguousCommit(
            format!(
                "could not re-read run {} after a lost connection: {}",
                token.run_id,
                last.map(|e| e.to_string()).unwrap_or_default()
            )
            .into(),
        ))
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
    mut conn: &AsyncPgConnection,
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
        .get_result(&mut conn)
        .await
        .optional()?;
    Ok(match found {
        Some(Current { current: true }) => Lineage::Current,
        Some(Current { current: false }) => Lineage::Changed,
        None => Lineage::Fenced,
    })
}

/// The fence (`sql::FENCE_SUCCESS`): the rows it marked `success`, 1 or 0.
async fn fence(
    mut conn: &AsyncPgConnection,
    token: &ClaimToken,
) -> Result<usize, diesel::result::Error> {
    diesel::sql_query(sql::FENCE_SUCCESS)
        .bind::<Text, _>(token.run_id.to_string())
        .bind::<Integer, _>(token.attempt)
        .cached()
        .execute(&mut conn)
        .await
}
