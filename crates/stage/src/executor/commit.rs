//! The fenced commit of one execution: the body's writes, the next stage's job and
//! the completion of its own job, in the transaction that marks the stage `success`.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use idemstage_domain::fanout::validate_child_keys;
use idemstage_domain::{
    child_item_id, input_hash_of, Child, ClaimToken, DomainError, JobCompleteOutcome, JobToSend,
    StageError, StageName,
};
use idemstage_persistence::fanout::NewChild;
use idemstage_persistence::FencedTx;

use crate::erased::Prepared;
use crate::pipeline::StageRole;
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
        let fan = FanPlan::of(pipeline, stage);
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
                let (stage, prepared, next_job, committed, fan) = (
                    stage.clone(),
                    prepared.clone(),
                    next_job.clone(),
                    committed.clone(),
                    fan.clone(),
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
                    if let Some(fan) = &fan {
                        fan.write(tx, &output, outcome).await?;
                    }
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

/// What a fan-out stage or a child's stage writes besides the plain flow: the
/// children and their jobs, or the child's final count and the gather's job.
#[derive(Clone)]
enum FanPlan {
    /// A fan-out: its children run `first_child`; `gather` after them.
    FanOut {
        pipeline: Pipeline,
        first_child: StageName,
        gather: StageName,
    },
    /// A child's stage: `last` makes the child final on success; any ends it
    /// on `Stop`.
    Child { pipeline: Pipeline, last: bool },
}

impl FanPlan {
    fn of(pipeline: &Pipeline, stage: &StageRef) -> Option<Self> {
        match pipeline.role(stage.name()) {
            StageRole::FanOut => Some(FanPlan::FanOut {
                pipeline: pipeline.clone(),
                first_child: pipeline.following(stage.name())?.name().clone(),
                gather: pipeline.gather_of(stage.name())?.name().clone(),
            }),
            StageRole::Child { last, .. } => Some(FanPlan::Child {
                pipeline: pipeline.clone(),
                last,
            }),
            StageRole::Plain | StageRole::Gather(_) => None,
        }
    }

    async fn write(
        &self,
        tx: &mut FencedTx<'_>,
        output: &serde_json::Value,
        flow: StageFlow,
    ) -> Result<(), StageError> {
        let token = tx.token().clone();
        match self {
            FanPlan::FanOut { .. } if flow == StageFlow::Stop => {
                // No children, no gather: the item ends here.
                if token.attempt > 1 {
                    tx.supersede_fan_outs().await?;
                }
                idemstage_persistence::reconcile::record_stop(tx).await?;
            }
            FanPlan::FanOut {
                pipeline,
                first_child,
                gather,
            } => {
                let children = children_of(&token, output)?;
                if token.attempt > 1 {
                    // A rerun: what an earlier attempt fanned out is replaced.
                    tx.supersede_fan_outs().await?;
                }
                let input_hash = tx.write_fan_out(gather, &children).await?;
                let jobs: Vec<JobToSend> = if children.is_empty() {
                    vec![pipeline.job_for(
                        gather,
                        &StageJob {
                            tenant_id: token.tenant.clone(),
                            item_id: token.item,
                            input_hash,
                        },
                    )]
                } else {
                    children
                        .iter()
                        .map(|c| {
                            pipeline.job_for(
                                first_child,
                                &StageJob {
                                    tenant_id: token.tenant.clone(),
                                    item_id: c.item,
                                    input_hash: c.input_sha256.clone(),
                                },
                            )
                        })
                        .collect()
                };
                tx.send_jobs(&jobs).await?;
            }
            FanPlan::Child { pipeline, last } => {
                let outcome = match (last, flow) {
                    (true, _) => "success",
                    (false, StageFlow::Stop) => "stopped",
                    (false, StageFlow::Continue) => return Ok(()),
                };
                if let Some(counted) = tx.child_final(outcome).await? {
                    if counted.gather_due() {
                        let job = pipeline.job_for(
                            &counted.gather_stage,
                            &StageJob {
                                tenant_id: token.tenant.clone(),
                                item_id: counted.parent,
                                input_hash: counted.input_hash,
                            },
                        );
                        tx.send_job(&job).await?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The children a fan-out's output names, with their item ids and input
/// texts: a child's input is stored as an item's (a JSON string as its text,
/// anything else as its JSON). Refused (permanently) if a key is empty, too
/// long or twice, an input empty or too large, or there are too many.
fn children_of(
    token: &ClaimToken,
    output: &serde_json::Value,
) -> Result<Vec<NewChild>, StageError> {
    let invalid =
        |e: DomainError| StageError::Permanent(format!("stage {}: {e}", token.stage).into());
    let children: Vec<Child<serde_json::Value>> =
        serde_json::from_value(output.clone()).map_err(|e| {
            invalid(DomainError::InvalidFanOut(format!(
                "its output is no list of children: {e}"
            )))
        })?;
    validate_child_keys(children.iter().map(|c| c.key.as_str())).map_err(invalid)?;
    children
        .into_iter()
        .map(|c| {
            let input_text = match c.input {
                serde_json::Value::String(text) => text,
                other => other.to_string(),
            };
            idemstage_persistence::items::validate_input(&input_text).map_err(|e| {
                invalid(DomainError::InvalidFanOut(format!(
                    "child {:?}: {e}",
                    c.key
                )))
            })?;
            Ok(NewChild {
                item: child_item_id(&token.item, &token.stage, token.attempt, &c.key),
                input_sha256: input_hash_of(input_text.as_bytes()),
                key: c.key,
                input_text,
            })
        })
        .collect()
}
