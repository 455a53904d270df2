//! Batched job completions: one task completes the jobs of many handlers.

use idemstage_domain::{FetchedJob, JobCompleteOutcome, JobId, RepoError};
use idemstage_persistence::queue;
use idemstage_persistence::PgPool;
use tokio::sync::{mpsc, oneshot};

/// Completes the jobs of many handlers with one `complete_many` each time: the
/// completions that arrive while one statement runs go together in the next
/// ("natural" batching, so a lone completion waits for nothing). One connection,
/// one statement and one commit serve a whole batch.
#[derive(Clone)]
pub(super) struct Completer {
    tx: mpsc::UnboundedSender<PendingCompletion>,
}

struct PendingCompletion {
    id: JobId,
    attempt: i32,
    reply: oneshot::Sender<Result<JobCompleteOutcome, RepoError>>,
}

/// Most completions per statement.
const COMPLETION_BATCH: usize = 256;

impl Completer {
    /// The loop ends when the last `Completer` is dropped.
    pub(super) fn start(pool: PgPool) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, tokio::spawn(completer_loop(pool, rx)))
    }

    pub(super) async fn complete(&self, job: &FetchedJob) -> Result<JobCompleteOutcome, RepoError> {
        let (reply, outcome) = oneshot::channel();
        let stopped = || RepoError::Unavailable("the job completer has stopped".into());
        self.tx
            .send(PendingCompletion {
                id: job.id,
                attempt: job.attempt,
                reply,
            })
            .map_err(|_| stopped())?;
        outcome.await.map_err(|_| stopped())?
    }
}

async fn completer_loop(pool: PgPool, mut rx: mpsc::UnboundedReceiver<PendingCompletion>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < COMPLETION_BATCH {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let tokens: Vec<(JobId, i32)> = batch.iter().map(|c| (c.id, c.attempt)).collect();
        let outcomes = async {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::complete_many(&mut conn, &tokens).await
        }
        .await;
        // Each waiting handler gets its own outcome, or the error to retry on.
        match outcomes {
            Ok(outcomes) => {
                for (pending, outcome) in batch.into_iter().zip(outcomes) {
                    let _ = pending.reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                for pending in batch {
                    let _ = pending.reply.send(Err(e.clone()));
                }
            }
        }
    }
}
