//! One stage execution: claim → skip, or prepare and run → fenced commit or fail.

mod commit;
mod guards;
mod outcome;
mod prepare;

use std::sync::Arc;

use idemstage_domain::{
    ClaimOutcome, ClaimRequest, ClaimToken, FailOutcome, JobId, RenewOutcome, RepoError,
    StageError, WorkerId,
};
use idemstage_persistence::runs::{InterruptOutcome, WaitOutcome};
use idemstage_persistence::PgRunRepository;
use tokio::sync::watch;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::{Pipeline, StageJob, StageRef};

use commit::Completion;
use guards::{AbortOnDrop, ReleaseOnDrop};
pub use outcome::ExecutionOutcome;
use prepare::Prepare;

/// The queue job an execution runs for, with its fencing token (`FetchedJob::attempt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobLease {
    /// The job's id.
    pub id: JobId,
    /// The job's delivery count at its fetch: the completion is fenced on it.
    pub attempt: i32,
}

/// Runs stage executions for one worker identity. The stage worker
/// (`idemstage::worker::PipelineWorker`) uses one; use it directly to run a stage without
/// a queue (in a test, a CLI). Clones share the identity and the pending releases.
#[derive(Clone)]
pub struct Executor {
    repo: Arc<PgRunRepository>,
    worker: WorkerId,
    /// Releases of executions dropped mid-way (see `ReleaseOnDrop`).
    releases: TaskTracker,
}

impl Executor {
    /// An executor that claims as `worker` through `repo`.
    pub fn new(repo: Arc<PgRunRepository>, worker: WorkerId) -> Self {
        Self {
            repo,
            worker,
            releases: TaskTracker::new(),
        }
    }

    /// Waits (at most `within`) for the releases of executions that were dropped
    /// before they finished: a worker calls it after its last execution, so that
    /// it exits only after giving its stages back.
    pub async fn finish_releases(&self, within: std::time::Duration) {
        self.releases.close();
        if tokio::time::timeout(within, self.releases.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                pending = self.releases.len(),
                "stage releases still running at exit; their leases will run out"
            );
        }
    }

    /// The worker identity its claims are recorded under.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }

    /// Executes `stage` of `pipeline` for `job`. On success the next stage's job is
    /// sent inside the same transaction that marks this stage `success`.
    pub async fn run(
        &self,
        pipeline: &Pipeline,
        stage: &StageRef,
        job: &StageJob,
    ) -> Result<ExecutionOutcome, RepoError> {
        self.execute(pipeline, stage, job, None).await
    }

    /// As `run`, for a fetched queue job: on success the job is also completed in
    /// the stage's transaction (`job_completed`), so the stage's success and its
    /// job's completion commit together, with one statement and one commit less
    /// than completing the job afterwards.
    pub async fn run_and_complete_job(
        &self,
        pipeline: &Pipeline,
        stage: &StageRef,
        job: &StageJob,
        lease: JobLease,
    ) -> Result<ExecutionOutcome, RepoError> {
        self.execute(pipeline, stage, job, Some(lease)).await
    }

    /// One execution inside its span (`stage` with tenant, item, stage, and
    /// the attempt once claimed), counted and timed for the metrics.
    async fn execute(
        &self,
        pipeline: &Pipeline,
        stage: &StageRef,
        job: &StageJob,
        lease: Option<JobLease>,
    ) -> Result<ExecutionOutcome, RepoError> {
        // At WARN, not INFO: a span is recorded only if its level passes the
        // filter, and the warnings of an execution (a failed attempt, a lost lease)
        // must carry whose it is under a filter of `warn` too (the CLI's default).
        let span = tracing::warn_span!(
            "stage",
            tenant = %job.tenant_id,
            item = %job.item_id,
            stage = %stage.name(),
            attempt = tracing::field::Empty,
        );
        let started = std::time::Instant::now();
        let outcome = self
            .claim_and_run(pipeline, stage, job, lease)
            .instrument(span)
            .await;
        crate::telemetry::record_execution(stage.name().as_str(), &outcome, started.elapsed());
        if let Ok(
            ExecutionOutcome::Failed { dead: true, .. } | ExecutionOutcome::Exhausted { .. },
        ) = &outcome
        {
            self.send_due_gather(pipeline, stage, job).await;
        }
        outcome
    }

    /// A child's stage ended `dead`: the trigger counted the child final; if
    /// that completed its fan-out, the gather's job goes now (not only with
    /// the reconciler's next pass). A failure here is logged: the reconciler
    /// sends it then.
    async fn send_due_gather(&self, pipeline: &Pipeline, stage: &StageRef, job: &StageJob) {
        if !matches!(pipeline.role(stage.name()), crate::StageRole::Child { .. }) {
            return;
        }
        let sent = self
            .repo
            .send_due_gather(&job.tenant_id, &job.item_id, |due| {
                pipeline.job_for(
                    &due.gather_stage,
                    &StageJob {
                        tenant_id: job.tenant_id.clone(),
                        item_id: due.parent,
                        input_hash: due.input_hash.clone(),
                    },
                )
            })
            .await;
        if let Err(e) = sent {
            tracing::warn!(error = %e, "could not send the gather's job after a dead child; the reconciler will");
        }
    }

    async fn claim_and_run(
        &self,
        pipeline: &Pipeline,
        stage: &StageRef,
        job: &StageJob,
        lease: Option<JobLease>,
    ) -> Result<ExecutionOutcome, RepoError> {
        let policy = stage.policy().clone();
        let req = ClaimRequest {
            tenant: job.tenant_id.clone(),
            item: job.item_id,
            stage: stage.name().clone(),
            input_hash: job.input_hash.clone(),
            worker: self.worker.clone(),
            policy: policy.clone(),
            upstream: pipeline.upstream_of(stage.name()).map(|s| s.name().clone()),
        };
        let claimed = if matches!(pipeline.role(stage.name()), crate::StageRole::Gather(_)) {
            self.repo.claim_gather(&req).await?
        } else {
            self.repo.claim(&req).await?
        };
        let (run_id, attempt, job) = match claimed {
            ClaimOutcome::Claimed {
                run_id,
                attempt,
                input_hash,
                ..
            } => {
                // The body and the next stage's job see the hash the database bound
                // (a later stage's job may carry an older one: it is a wake-up).
                let bound = StageJob {
                    input_hash,
                    ..job.clone()
                };
                (run_id, attempt, bound)
            }
            ClaimOutcome::Skipped(reason) => return Ok(ExecutionOutcome::Skipped(reason)),
            ClaimOutcome::Rejected(reason) => return Ok(ExecutionOutcome::Rejected(reason)),
            ClaimOutcome::Exhausted { attempts } => {
                return Ok(ExecutionOutcome::Exhausted { attempts })
            }
        };
        let token = ClaimToken {
            run_id,
            tenant: job.tenant_id.clone(),
            item: job.item_id,
            stage: stage.name().clone(),
            attempt,
        };
        tracing::Span::current().record("attempt", attempt);
        // Until the outcome is known: if this future is dropped (its job's handler
        // aborted after the shutdown grace, say), the stage is given back at once
        // instead of staying `running` until its lease runs out.
        let mut release = ReleaseOnDrop {
            repo: self.repo.clone(),
            token: Some(token.clone()),
            tracker: self.releases.clone(),
            span: tracing::Span::current(),
        };

        // The heartbeat renews the lease while the body runs and reports a lost lease,
        // which cancels the body: its results could never commit anyway.
        let (lost_tx, mut lost_rx) = watch::channel(false);
        // Aborted when this future is dropped (its job's handler aborted, say): a
        // heartbeat that outlived its execution would keep the stage `running` for
        // ever with nobody running it.
        let heartbeat = AbortOnDrop({
            let repo = self.repo.clone();
            let token = token.clone();
            let (every, lease) = (policy.heartbeat, policy.lease);
            tokio::spawn(
                async move {
                    let mut ticker = tokio::time::interval(every);
                    ticker.tick().await;
                    loop {
                        ticker.tick().await;
                        let stage = token.stage.as_str();
                        match repo.renew_lease(&token, lease).await {
                            Ok(RenewOutcome::Renewed { .. }) => {
                                crate::telemetry::record_renewal(stage, "renewed");
                            }
                            // Counted as `lost` by the execution, unless its own
                            // commit ended the lease.
                            Ok(RenewOutcome::Fenced) => {
                                let _ = lost_tx.send(true);
                                return;
                            }
                            // A passing database problem: keep trying until the lease is
                            // really gone; the fenced commit decides in the end.
                            Err(e) => {
                                crate::telemetry::record_renewal(stage, "error");
                                tracing::warn!(error = %e, "lease renewal failed");
                            }
                        }
                    }
                }
                .instrument(tracing::Span::current()),
            )
        });
        let prepare_lease_lost = lost_rx.clone();
        let body = async {
            let prepared = match self
                .prepare(stage, &job, &token, &policy, prepare_lease_lost)
                .await?
            {
                Prepare::Ready(prepared) => prepared,
                Prepare::Settled(completion) => return Ok(completion),
            };
            self.commit(pipeline, stage, &job, &token, prepared, lease)
                .await
        };
        let timeout = policy.timeout;
        let mut body = std::pin::pin!(async move {
            tokio::time::timeout(timeout, body)
                .await
                .unwrap_or(Err(StageError::TimedOut(timeout)))
        });
        let result = tokio::select! {
            // The body first: a result it has is the outcome.
            biased;
            r = &mut body => r,
            _ = async {
                // A dropped sender (the heartbeat ended) is no evidence of a lost lease.
                if lost_rx.wait_for(|lost| *lost).await.is_err() {
                    std::future::pending::<()>().await;
                }
            } => {
                // The renewal found the lease gone. That may be this attempt's own
                // commit (the renewal waited on the commit's row lock, then found the
                // stage succeeded): the body is about to say so, so give it a moment
                // before cancelling it, lest a success be reported as fenced.
                match tokio::time::timeout(LOST_LEASE_GRACE, &mut body).await {
                    Ok(r) => r,
                    Err(_) => Ok(Completion::Fenced),
                }
            }
        };
        if matches!(result, Ok(Completion::Fenced)) && *lost_rx.borrow() {
            crate::telemetry::record_renewal(token.stage.as_str(), "lost");
            tracing::warn!("stage lease lost (taken over); the attempt is fenced");
        }
        drop(heartbeat);
        release.disarm();

        match result {
            Ok(Completion::Committed {
                flow,
                job_completed,
            }) => Ok(ExecutionOutcome::Succeeded {
                run_id,
                attempt,
                flow,
                job_completed,
            }),
            Ok(Completion::Fenced) => {
                self.repo.record_fenced(&token).await?;
                Ok(ExecutionOutcome::Fenced { attempt })
            }
            Ok(Completion::UpstreamChanged) => Ok(ExecutionOutcome::UpstreamChanged { attempt }),
            Err(StageError::RateLimited { retry_after }) => {
                tracing::info!(?retry_after, "stage rate limited; released, bucket held");
                self.repo
                    .release(
                        &token,
                        &format!("rate limited, not counted: retry after {retry_after:?}"),
                    )
                    .await?;
                self.repo
                    .hold(token.stage.as_str(), &token.tenant, retry_after)
                    .await?;
                Ok(ExecutionOutcome::RateLimited {
                    attempt,
                    retry_after,
                })
            }
            Err(StageError::Wait(wait)) => match self.repo.wait(&token, &wait).await? {
                WaitOutcome::Waiting { until } => {
                    tracing::info!(signal = ?wait.signal, %until, "stage waits");
                    Ok(ExecutionOutcome::Waiting { attempt, until })
                }
                WaitOutcome::Fenced => Ok(ExecutionOutcome::Fenced { attempt }),
            },
            Err(error) if is_infrastructure(&error) => {
                // The database, not the stage: give the claim back uncounted, so
                // that an outage or a lock timeout cannot use up the stage's
                // budget; but only so many times in a row, so that an error that
                // merely looks passing cannot loop for ever.
                let message = error.to_string();
                Ok(
                    match self
                        .repo
                        .interrupt(&token, &message, policy.max_interruptions)
                        .await?
                    {
                        InterruptOutcome::Released { in_row } => {
                            tracing::warn!(error = %message, in_row, "stage attempt interrupted by the database; released");
                            ExecutionOutcome::Interrupted {
                                attempt,
                                error: message,
                            }
                        }
                        InterruptOutcome::Counted { attempt, dead } => {
                            tracing::warn!(error = %message, dead, "stage attempt interrupted once too often in a row; counted as failed");
                            ExecutionOutcome::Failed {
                                attempt,
                                error: message,
                                dead,
                            }
                        }
                        InterruptOutcome::Fenced => ExecutionOutcome::Fenced { attempt },
                    },
                )
            }
            Err(error) => {
                let message = error.to_string();
                tracing::warn!(error = %message, "stage attempt failed");
                Ok(
                    match self
                        .repo
                        .fail(&token, &message, error.is_retryable())
                        .await?
                    {
                        FailOutcome::WillRetry { attempt } => ExecutionOutcome::Failed {
                            attempt,
                            error: message,
                            dead: false,
                        },
                        FailOutcome::Exhausted { attempts } => ExecutionOutcome::Failed {
                            attempt: attempts,
                            error: message,
                            dead: true,
                        },
                        FailOutcome::Fenced => ExecutionOutcome::Fenced { attempt },
                    },
                )
            }
        }
    }
}

/// How long an execution whose lease renewal came back fenced still waits for its
/// body's result before cancelling it: long enough for the reply to a commit that
/// has just ended the lease itself.
const LOST_LEASE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// A failure of the database rather than of the stage body: retryable repository
/// errors (timeouts, lost connections, conflicts that outlived their retries,
/// resources).
fn is_infrastructure(error: &StageError) -> bool {
    matches!(error, StageError::Repo(e) if e.is_retryable())
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> StageError {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned());
    StageError::Panicked(message)
}
