//! The stage worker's job handler: runs a stage job through the executor and
//! turns its `ExecutionOutcome` into what happens to the job (completed only when
//! the stage is final; deferred while someone else holds it or its upstream is
//! unfinished; failed when it can never run).

use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::{FetchedJob, RejectReason, RunStatus, SkipReason};
use idemstage_stage::{ExecutionOutcome, Executor, JobLease, Pipeline, StageJob};

use crate::{Counters, Handled, HandlerError, JobHandler};

pub(super) struct PipelineHandler {
    pub(super) pipeline: Pipeline,
    pub(super) executor: Executor,
    pub(super) counters: Arc<Counters>,
}

/// A little after the holder's lease, so the deferred job finds it expired.
const DEFER_SLACK: Duration = Duration::from_millis(50);

impl JobHandler for PipelineHandler {
    type Payload = serde_json::Value;

    async fn handle(
        &self,
        job: FetchedJob,
        payload: serde_json::Value,
    ) -> Result<Handled, HandlerError> {
        let stage = self
            .pipeline
            .stage(&job.queue)
            .map_err(HandlerError::permanent)?;
        let stage_job =
            StageJob::from_payload(&job.queue, &payload).map_err(HandlerError::permanent)?;
        let lease = JobLease {
            id: job.id,
            attempt: job.attempt,
        };
        let outcome = match self
            .executor
            .run_and_complete_job(&self.pipeline, stage, &stage_job, lease)
            .await
        {
            Ok(outcome) => outcome,
            // Nothing was claimed for a job that names no such item, another
            // tenant's, or bad ids: the job is wrong, and fails for good.
            Err(e) if e.is_bad_request() => return Err(HandlerError::permanent(e)),
            // Anything else is the database's: the stage may be claimed and not
            // final, so the job must live on. Wait with backoff, count nothing.
            Err(e) => {
                return Err(HandlerError::DeferFor {
                    after: backoff(job.attempt),
                    reason: format!("database error: {e}"),
                })
            }
        };
        let c = &self.counters;
        match outcome {
            ExecutionOutcome::Succeeded { job_completed, .. } => {
                Counters::bump(&c.succeeded);
                if let Some(successes) = &c.successes {
                    let key = format!(
                        "{}:{}:{}",
                        stage.name(),
                        stage_job.tenant_id,
                        stage_job.item_id
                    );
                    *successes.lock().unwrap().entry(key).or_default() += 1;
                }
                Ok(if job_completed {
                    Handled::AlreadyCompleted
                } else {
                    Handled::Complete
                })
            }
            // A waiting stage has no job: the end of its wait sends one.
            ExecutionOutcome::Waiting { .. } => {
                Counters::bump(&c.skipped);
                Ok(Handled::Complete)
            }
            ExecutionOutcome::Skipped(
                SkipReason::AlreadySucceeded { .. }
                | SkipReason::Cancelled { .. }
                | SkipReason::Waiting { .. }
                | SkipReason::Superseded,
            ) => {
                Counters::bump(&c.skipped);
                Ok(Handled::Complete)
            }
            // A gather sent early (an operator's retry, a parent's rerun while
            // its job was live): kept live, so that the send of the child that
            // completes the fan-out (a duplicate of it) is not lost.
            ExecutionOutcome::Skipped(SkipReason::ChildrenNotFinal {
                final_children,
                children,
            }) => {
                Counters::bump(&c.deferred);
                Err(HandlerError::DeferFor {
                    after: backoff(job.attempt),
                    reason: format!("{final_children} of {children} children final"),
                })
            }
            ExecutionOutcome::Skipped(SkipReason::InFlight { lease_expires_at }) => {
                Counters::bump(&c.deferred);
                Err(HandlerError::Defer {
                    until: Some(lease_expires_at + DEFER_SLACK),
                    reason: "another worker holds this stage".into(),
                })
            }
            ExecutionOutcome::Skipped(SkipReason::UpstreamNotDone {
                upstream,
                status,
                lease_expires_at,
            }) => {
                Counters::bump(&c.deferred);
                match (status, lease_expires_at) {
                    // Final without a success: nothing will ever be computed from it
                    // (its success, should it come, sends this stage's job anew).
                    // Waiting: its success, after the wait, sends this job anew.
                    (Some(RunStatus::Dead | RunStatus::Cancelled | RunStatus::Waiting), _) => {
                        Ok(Handled::Complete)
                    }
                    (_, Some(lease)) => Err(HandlerError::Defer {
                        until: Some(lease + DEFER_SLACK),
                        reason: format!("upstream stage {upstream} is running"),
                    }),
                    // Not started, failed (retrying) or stale: look again later. Its
                    // success would find this job live (a duplicate send), so this
                    // job must stay live until then.
                    _ => Err(HandlerError::DeferFor {
                        after: backoff(job.attempt),
                        reason: format!("upstream stage {upstream} has no success yet"),
                    }),
                }
            }
            ExecutionOutcome::Fenced { .. } | ExecutionOutcome::UpstreamChanged { .. } => {
                // Someone took the stage over, or it must run again on a new
                // upstream: look again shortly rather than trust that another job
                // outlives this one.
                Counters::bump(&c.fenced);
                Err(HandlerError::Defer {
                    until: None,
                    reason: "lease lost, or the upstream changed".into(),
                })
            }
            ExecutionOutcome::RateLimited { retry_after, .. } => {
                Counters::bump(&c.rate_limited);
                Err(HandlerError::DeferFor {
                    after: retry_after,
                    reason: format!("stage {} is rate limited", stage.name()),
                })
            }
            ExecutionOutcome::Interrupted { error, .. } => {
                Counters::bump(&c.interrupted);
                Err(HandlerError::DeferFor {
                    after: backoff(job.attempt),
                    reason: error,
                })
            }
            ExecutionOutcome::Rejected(reason @ RejectReason::InputMismatch { .. }) => {
                // A newer send may have replaced the payload (an input replaced under
                // `Rerun`): retried with the job's budget, nothing bound meanwhile.
                Counters::bump(&c.rejected);
                Err(HandlerError::Transient(format!(
                    "stage {} refused the job: {reason:?}",
                    stage.name()
                )))
            }
            ExecutionOutcome::Rejected(reason) => {
                Counters::bump(&c.rejected);
                Err(HandlerError::permanent(format!(
                    "stage {} refused the job: {reason:?}",
                    stage.name()
                )))
            }
            ExecutionOutcome::Failed {
                error, dead: false, ..
            } => {
                Counters::bump(&c.failed);
                Err(HandlerError::Transient(error))
            }
            ExecutionOutcome::Failed {
                error, dead: true, ..
            } => {
                Counters::bump(&c.dead);
                Err(HandlerError::Permanent(error))
            }
            ExecutionOutcome::Exhausted { .. } => {
                Counters::bump(&c.exhausted);
                Ok(Handled::Complete)
            }
        }
    }
}

/// How long a job waits after its `attempt`-th delivery ended in a database
/// problem or an unfinished upstream: doubling from 100 ms, at most 30 s, with
/// jitter so that jobs deferred together do not come back together.
fn backoff(attempt: i32) -> Duration {
    let exp = u32::try_from(attempt.clamp(1, 9) - 1).unwrap_or(0);
    let full = Duration::from_millis(100 << exp).min(Duration::from_secs(30));
    full.mul_f64(0.5 + rand::random::<f64>() / 2.0)
}
