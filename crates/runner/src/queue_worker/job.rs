//! One job's task: deserialize, run the handler (while the worker's lease keeper
//! keeps the job leased, within its timeout), and record how it ended under the
//! job's token. A completion is handed to the completer, which records it in a
//! batch, so the handler slot is free before the completion's round trip.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use idemstage_domain::{FailKind, FetchedJob, JobFailOutcome, JobId, JobRetryOutcome, RepoError};
use idemstage_persistence::queue;
use idemstage_persistence::PgPool;
use tokio_util::sync::CancellationToken;

use super::completer::Completer;
use super::handler::{Handled, HandlerError, JobHandler};
use super::lease::HeldLease;
use super::stats::WorkerStats;
use crate::telemetry;

/// What every job task of one worker shares.
pub(super) struct JobContext<H> {
    pub(super) pool: PgPool,
    pub(super) completer: Completer,
    pub(super) handler: H,
    /// Cancelled when the shutdown grace is over: handlers still running are
    /// aborted and their jobs given back.
    pub(super) hard_stop: CancellationToken,
    pub(super) stats: Arc<WorkerStats>,
    pub(super) backoff_min: Duration,
    pub(super) handler_timeout: Option<Duration>,
}

/// How a job's run ended, to be recorded under its token.
enum Finish {
    /// The completer completes it.
    Complete,
    /// Completed by the handler in its own transaction: nothing to write.
    AlreadyCompleted,
    /// This task writes it.
    Write(Write),
}

/// The outcomes written by the job's own task, one statement each.
enum Write {
    Fail(String, FailKind),
    /// Shutdown: give the job back unfinished.
    Release,
    /// Give the job back to be fetched after this time.
    Defer(Option<chrono::DateTime<chrono::Utc>>),
    /// Give the job back to be fetched after this long.
    DeferFor(Duration),
}

/// The job's token and queue, for recording after the handler took the job.
struct Token {
    id: JobId,
    attempt: i32,
    queue: String,
}

pub(super) async fn run_job<H: JobHandler>(
    cx: Arc<JobContext<H>>,
    job: FetchedJob,
    lease: HeldLease,
) {
    if lease.is_lost() {
        // Taken over while it waited for a slot: someone else's job now.
        tracing::warn!(job = %job.id, "job lease lost before its handler started; not run");
        WorkerStats::add(&cx.stats.fenced, 1);
        telemetry::count_job(telemetry::JOBS_FENCED, &job.queue, 1);
        return;
    }
    let token = Token {
        id: job.id,
        attempt: job.attempt,
        queue: job.queue.clone(),
    };
    let finish = match job.payload_as::<H::Payload>() {
        Err(e) => Finish::Write(Write::Fail(e.to_string(), FailKind::Permanent)),
        Ok(payload) => {
            // A panic is caught here (and fails the job), not unwound into the worker.
            let handled = catch_unwind(cx.handler.handle(job, payload));
            // Our clock, but only for giving up on a handler: the database's clock
            // decides the lease.
            let timeout = async {
                match cx.handler_timeout {
                    Some(t) => tokio::time::sleep(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // First: a handler that has just returned keeps its result, even if
                // the lease keeper found the lease ended (a handler that completed
                // the job itself ends its lease too).
                biased;
                handled = handled => finish_of(handled),
                // The lease keeper renews the lease while the handler runs, so a job
                // outlives a slow handler but not a dead worker. If the lease was
                // taken over, the job is someone else's now: stop (dropping the
                // handler's future aborts it), and record nothing.
                _ = lease.lost() => {
                    tracing::warn!(job = %token.id, "job lease lost (taken over after it expired); handler aborted");
                    WorkerStats::add(&cx.stats.fenced, 1);
                    telemetry::count_job(telemetry::JOBS_FENCED, &token.queue, 1);
                    return;
                }
                _ = cx.hard_stop.cancelled() => Finish::Write(Write::Release),
                _ = timeout => Finish::Write(Write::Fail(
                    format!("handler did not finish within {:?}", cx.handler_timeout.unwrap_or_default()),
                    FailKind::Transient,
                )),
            }
        }
    };
    // Recorded without renewing: the lease has at least two thirds left.
    drop(lease);
    match finish {
        // Written by the handler: nothing to do.
        Finish::AlreadyCompleted => {
            WorkerStats::add(&cx.stats.completed, 1);
            telemetry::count_job(telemetry::JOBS_COMPLETED, &token.queue, 1);
            tracing::debug!(job = %token.id, attempt = token.attempt, what = "completed", "job recorded");
        }
        // The completer records it (and counts it) with the completions of other
        // handlers; this waits only while its queue is full.
        Finish::Complete => {
            cx.completer
                .complete(token.id, token.attempt, token.queue)
                .await
        }
        Finish::Write(write) => record(&cx, &token, write).await,
    }
}

fn finish_of(handled: Result<Result<Handled, HandlerError>, Box<dyn Any + Send>>) -> Finish {
    match handled {
        Ok(Ok(Handled::Complete)) => Finish::Complete,
        Ok(Ok(Handled::AlreadyCompleted)) => Finish::AlreadyCompleted,
        Ok(Err(HandlerError::Transient(m))) => Finish::Write(Write::Fail(m, FailKind::Transient)),
        Ok(Err(HandlerError::Permanent(m))) => Finish::Write(Write::Fail(m, FailKind::Permanent)),
        Ok(Err(HandlerError::Defer { until, .. })) => Finish::Write(Write::Defer(until)),
        Ok(Err(HandlerError::DeferFor { after, .. })) => Finish::Write(Write::DeferFor(after)),
        Err(panic) => Finish::Write(Write::Fail(
            format!("handler panicked: {}", panic_message(panic)),
            FailKind::Transient,
        )),
    }
}

/// Polls `f`, turning a panic during a poll into `Err` with its payload (and not
/// polling `f` again).
async fn catch_unwind<F: Future>(f: F) -> Result<F::Output, Box<dyn Any + Send>> {
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(move |cx| {
        match std::panic::catch_unwind(AssertUnwindSafe(|| f.as_mut().poll(cx))) {
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(panic) => Poll::Ready(Err(panic)),
        }
    })
    .await
}

/// Records a failure, a release or a deferral, retrying transient database errors
/// a few times. If that still fails, the job stays active until its lease expires
/// and maintenance retries it. After a lost connection a retry may report `Fenced`
/// because the first attempt did commit; both end the job's lease here.
async fn record<H>(cx: &JobContext<H>, job: &Token, write: Write) {
    const TRIES: u32 = 5;
    let stats = &cx.stats;
    let mut delay = cx.backoff_min;
    for tries in 1..=TRIES {
        let result = async {
            let mut conn = idemstage_persistence::get(&cx.pool).await?;
            Ok::<_, RepoError>(match &write {
                Write::Fail(msg, kind) => {
                    // Sanitised: a NUL or a huge message must not make the failure
                    // itself fail (and leave the job active until its lease ends).
                    let text = idemstage_domain::sanitize_error_text(msg);
                    match queue::fail(&mut conn, job.id, job.attempt, &text, *kind).await? {
                        JobFailOutcome::Retrying { .. } => {
                            tracing::info!(job = %job.id, queue = %job.queue, error = %msg, "job failed; will retry");
                            (&stats.failed, telemetry::JOBS_RETRIED, "failed")
                        }
                        JobFailOutcome::Failed { .. } => {
                            tracing::info!(job = %job.id, queue = %job.queue, error = %msg, "job failed");
                            (&stats.failed, telemetry::JOBS_FAILED, "failed")
                        }
                        JobFailOutcome::Fenced => (&stats.fenced, telemetry::JOBS_FENCED, "fenced"),
                    }
                }
                Write::Release => match queue::retry_now(&mut conn, job.id, job.attempt).await? {
                    JobRetryOutcome::Requeued => {
                        (&stats.released, telemetry::JOBS_RELEASED, "released")
                    }
                    JobRetryOutcome::Fenced => (&stats.fenced, telemetry::JOBS_FENCED, "fenced"),
                },
                Write::Defer(until) => {
                    match queue::retry_at(&mut conn, job.id, job.attempt, *until).await? {
                        JobRetryOutcome::Requeued => {
                            (&stats.deferred, telemetry::JOBS_DEFERRED, "deferred")
                        }
                        JobRetryOutcome::Fenced => {
                            (&stats.fenced, telemetry::JOBS_FENCED, "fenced")
                        }
                    }
                }
                Write::DeferFor(after) => {
                    match queue::retry_after(&mut conn, job.id, job.attempt, *after).await? {
                        JobRetryOutcome::Requeued => {
                            (&stats.deferred, telemetry::JOBS_DEFERRED, "deferred")
                        }
                        JobRetryOutcome::Fenced => {
                            (&stats.fenced, telemetry::JOBS_FENCED, "fenced")
                        }
                    }
                }
            })
        }
        .await;
        match result {
            Ok((counter, metric, what)) => {
                WorkerStats::add(counter, 1);
                telemetry::count_job(metric, &job.queue, 1);
                tracing::debug!(job = %job.id, attempt = job.attempt, what, "job recorded");
                return;
            }
            Err(e) if e.is_retryable() && tries < TRIES => {
                tracing::warn!(job = %job.id, error = %e, "recording the job outcome failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => {
                tracing::error!(job = %job.id, error = %e, "could not record the job outcome; its lease will expire");
                return;
            }
        }
    }
}

fn panic_message(payload: Box<dyn Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
