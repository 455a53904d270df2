//! The prepare phase of one execution, outside any transaction: what the run is
//! bound to (and a checkpoint on that binding), the stage's `prepare` (or the
//! checkpoint it is spared by), and the checkpoint of what it returned.

use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use idemstage_domain::{ClaimToken, CompleteOutcome, StageError, StagePolicy};
use idemstage_persistence::runs::{BoundInput, ReadBound};
use tokio::sync::watch;

use crate::contract::AttemptInfo;
use crate::erased::{Bound, Prepared};
use crate::{StageJob, StageRef};

use super::commit::Completion;
use super::{panic_message, Executor};

/// What the prepare phase ended in.
pub(super) enum Prepare {
    /// Ready for the fenced commit.
    Ready(Prepared),
    /// Settled before `prepare`: the token no longer holds, or the bound upstream
    /// attempt is gone (the run is now `stale`).
    Settled(Completion),
}

impl Executor {
    pub(super) async fn prepare(
        &self,
        stage: &StageRef,
        job: &StageJob,
        token: &ClaimToken,
        policy: &StagePolicy,
        lease_lost: watch::Receiver<bool>,
    ) -> Result<Prepare, StageError> {
        // What the run is bound to, and a checkpoint of an earlier attempt on the
        // same binding: one statement, and none when there is nothing to read (the
        // commit still checks the lineage).
        let (input, checkpoint) = if stage
            .erased()
            .reads_binding(token.attempt, policy.reuse_prepared)
        {
            match self.repo.read_bound(token, policy.reuse_prepared).await? {
                ReadBound::Read { input, checkpoint } => (input, checkpoint),
                ReadBound::Fenced => return Ok(Prepare::Settled(Completion::Fenced)),
                // The upstream attempt this run is bound to is no longer its
                // success: this attempt can never commit; settle it `stale`.
                ReadBound::UpstreamMoved => {
                    return Ok(Prepare::Settled(
                        match self.repo.stale_on_lineage(token).await? {
                            CompleteOutcome::UpstreamChanged => Completion::UpstreamChanged,
                            _ => Completion::Fenced,
                        },
                    ))
                }
            }
        } else {
            (BoundInput::UpstreamOutput(serde_json::Value::Null), None)
        };
        let info = AttemptInfo {
            run_id: token.run_id,
            tenant: token.tenant.clone(),
            item: token.item,
            stage: token.stage.clone(),
            attempt: token.attempt,
            input_hash: job.input_hash.clone(),
        };
        let bound = Bound {
            input,
            checkpoint,
            attempt: &info,
            repo: &self.repo,
            lease_lost,
            reuse_prepared: policy.reuse_prepared,
        };
        let prepared = AssertUnwindSafe(stage.erased().prepare(bound))
            .catch_unwind()
            .await
            .map_err(panic_message)??;
        if let Some(value) = &prepared.checkpoint {
            // Kept for the next attempt on this binding. A failure here costs only
            // the reuse: the commit decides the attempt.
            if let Err(e) = self.repo.checkpoint(token, value).await {
                tracing::warn!(error = %e, "prepared value not checkpointed");
            }
        }
        Ok(Prepare::Ready(prepared))
    }
}
