//! Batched job completions: one task completes the jobs of many handlers, and
//! records (counts, logs) each outcome itself, so a handler's task ends, and its
//! slot is free, as soon as it has handed its completion over.

use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::{JobCompleteOutcome, JobId};
use idemstage_persistence::queue;
use idemstage_persistence::PgPool;
use tokio::sync::mpsc;

use super::stats::WorkerStats;
use crate::telemetry;

/// Completes the jobs of many handlers with one `complete_many` each time: the
/// completions that arrive while one statement runs go together in the next
/// ("natural" batching, so a lone completion waits for nothing). One connection,
/// one statement and one commit serve a whole batch. Every completion is fenced on
/// its job's `(id, attempt)`: one whose lease was taken over is not completed, and
/// is counted as `fenced`.
#[derive(Clone)]
pub(super) struct Completer {
    tx: mpsc::Sender<Completion>,
}

/// A job to complete: its token, and its queue (for the metrics).
type Completion = ((JobId, i32), String);

/// Most completions per statement, and most completions waiting: a handler that
/// finds this many waiting waits too (with its slot taken), so while the database
/// is slow to complete, the worker stops fetching instead of piling up jobs.
const COMPLETION_BATCH: usize = 256;

impl Completer {
    /// The loop ends, after recording what it was handed, when the last
    /// `Completer` is dropped.
    pub(super) fn start(
        pool: PgPool,
        stats: Arc<WorkerStats>,
        backoff_min: Duration,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(COMPLETION_BATCH);
        (
            Self { tx },
            tokio::spawn(completer_loop(pool, rx, stats, backoff_min)),
        )
    }

    /// Hands the completion of the job's `attempt` (of `queue`) over.
    pub(super) async fn complete(&self, id: JobId, attempt: i32, queue: String) {
        if self.tx.send(((id, attempt), queue)).await.is_err() {
            // Only if the completer's task died: the job's lease will expire.
            tracing::error!(job = %id, "the job completer has stopped; the job's lease will expire");
        }
    }
}

async fn completer_loop(
    pool: PgPool,
    mut rx: mpsc::Receiver<Completion>,
    stats: Arc<WorkerStats>,
    backoff_min: Duration,
) {
    let mut received = Vec::with_capacity(COMPLETION_BATCH);
    let mut batch = Vec::with_capacity(COMPLETION_BATCH);
    let mut queues = Vec::with_capacity(COMPLETION_BATCH);
    while rx.recv_many(&mut received, COMPLETION_BATCH).await > 0 {
        for (token, queue) in received.drain(..) {
            batch.push(token);
            queues.push(queue);
        }
        complete_batch(&pool, &batch, &queues, &stats, backoff_min).await;
        batch.clear();
        queues.clear();
    }
}

/// Completes `batch`, retrying transient database errors a few times. If that
/// still fails, the jobs stay active until their leases expire and maintenance
/// retries them. After a lost connection a retry may report `Fenced` because the
/// first attempt did commit.
async fn complete_batch(
    pool: &PgPool,
    batch: &[(JobId, i32)],
    queues: &[String],
    stats: &WorkerStats,
    backoff_min: Duration,
) {
    const TRIES: u32 = 5;
    let mut delay = backoff_min;
    for tries in 1..=TRIES {
        let outcomes = async {
            let mut conn = idemstage_persistence::get(pool).await?;
            queue::complete_many(&mut conn, batch).await
        }
        .await;
        match outcomes {
            Ok(outcomes) => {
                for ((id, attempt), outcome) in batch.iter().zip(&outcomes) {
                    let what = match outcome {
                        JobCompleteOutcome::Completed => "completed",
                        JobCompleteOutcome::Fenced => "fenced",
                    };
                    tracing::debug!(job = %id, attempt, what, "job recorded");
                }
                let of = |wanted: JobCompleteOutcome| {
                    queues
                        .iter()
                        .zip(&outcomes)
                        .filter(move |(_, outcome)| **outcome == wanted)
                        .map(|(queue, _)| queue.as_str())
                };
                telemetry::count_jobs(telemetry::JOBS_COMPLETED, of(JobCompleteOutcome::Completed));
                telemetry::count_jobs(telemetry::JOBS_FENCED, of(JobCompleteOutcome::Fenced));
                let completed = outcomes
                    .iter()
                    .filter(|o| **o == JobCompleteOutcome::Completed)
                    .count() as u64;
                WorkerStats::add(&stats.completed, completed);
                WorkerStats::add(&stats.fenced, batch.len() as u64 - completed);
                return;
            }
            Err(e) if e.is_retryable() && tries < TRIES => {
                tracing::warn!(error = %e, jobs = batch.len(), "completing jobs failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => {
                tracing::error!(error = %e, jobs = batch.len(), "could not complete jobs; their leases will expire");
                return;
            }
        }
    }
}
