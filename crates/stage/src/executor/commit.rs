//! The fenced commit of one execution: the body's writes, the next stage's job and
//! the completion of its own job, in the transaction that marks the stage `success`.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use idemstage_domain::{ClaimToken, JobCompleteOutcome, StageError};
use idemstage_persistence::FencedTx;

use crate::erased::Prepared;
use crate::{Pipeline, StageFlow, StageJob, StageRef};

use super::{panic_message, Executor, JobLease};

impl Executor {
    /// The fenced transaction: the body's writes, then the next stage's job, then
    /// the completion of this execution's own job.
    pub(super) async fn commit(
        &self,
        pipeline: &Pipeline,
        stage: &StageRef,
        job: &StageJob,
        token: &ClaimToken,
        prepared: Prepared,
        lease: Option<JobLease>,
    ) -> Result<Completion, StageError> {
        let next_job = pipeline
            .next(stage.name())
            .map(|next| pipeline.job_for(next.name(), job));
        // `Fn`, because a conflict re-runs the transaction; what the attempt that
        // committed did (its flow, whether it completed the job) is reported.
        let committed = Arc::new(std::sync::Mutex::new((StageFlow::Continue, false)));
        let write = {
            let (stage, prepared, committed) = (
                stage.erased().clone(),
                Arc::new(prepared),
                committed.clone(),
            );
            fenced_write(move |tx| {
                let (stage, prepared, next_job, committed) = (
                    stage.clone(),
                    prepared.clone(),
                    next_job.clone(),
                    committed.clone(),
                );
                async move {
                    let (output, outcome) = AssertUnwindSafe(stage.commit(tx, &prepared))
                        .catch_unwind()
                        .await
                        .map_err(panic_message)??;
                    // Kept with this attempt (its success_attempt now). A first
                    // attempt's run never had an output: `null` needs no write.
                    let used_checkpoint = prepared.checkpoint.is_some() || prepared.reused;
                    let record = (!output.is_null() || tx.token().attempt > 1 || used_checkpoint)
                        .then_some((&output, used_checkpoint));
                    let next = match (outcome, &next_job) {
                        (StageFlow::Continue, Some(next_job)) => Some(next_job),
                        (StageFlow::Stop, Some(_)) => {
                            // The next stage is not expected after this success:
                            // the reconciler must not send its job.
                            idemstage_persistence::reconcile::record_stop(tx).await?;
                            None
                        }
                        _ => None,
                    };
                    // One round trip for both. The completion last, so that its
                    // row lock is held for the shortest time. A job taken over
                    // (Fenced) is left to its new holder, who will find the stage
                    // succeeded.
                    let (_, completed) = tx
                        .finish(record, next, lease.map(|l| (l.id, l.attempt)))
                        .await?;
                    let flow = outcome;
                    let job_completed = completed == Some(JobCompleteOutcome::Completed);
                    *committed.lock().unwrap() = (flow, job_completed);
                    Ok(())
                }
                .boxed()
            })
        };
        Ok(match self.repo.complete(token, &write).await? {
            idemstage_domain::CompleteOutcome::Committed => {
                let (flow, job_completed) = *committed.lock().unwrap();
                Completion::Committed {
                    flow,
                    job_completed,
                }
            }
            idemstage_domain::CompleteOutcome::Fenced => Completion::Fenced,
            idemstage_domain::CompleteOutcome::UpstreamChanged => Completion::UpstreamChanged,
        })
    }
}

/// The completion as the executor sees it (carrying what the committed attempt of
/// the transaction did).
pub(super) enum Completion {
    Committed {
        flow: StageFlow,
        job_completed: bool,
    },
    Fenced,
    UpstreamChanged,
}

/// Pins the closure to the higher-ranked signature `FencedWrite` needs (closure
/// signatures are not inferred as higher-ranked from a later use).
fn fenced_write<F>(f: F) -> F
where
    F: for<'t, 'c> Fn(&'t mut FencedTx<'c>) -> BoxFuture<'t, Result<(), StageError>> + Send + Sync,
{
    f
}
