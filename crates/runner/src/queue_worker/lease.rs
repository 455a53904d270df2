//! The worker's leases: one task renews the lease of every job the worker holds
//! (running, or fetched ahead and waiting) with one fenced statement per round,
//! instead of a timer and a statement per job. A job whose renewal comes back
//! fenced was taken over: its holder is told, and stops.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idemstage_domain::{FetchedJob, JobId};
use idemstage_persistence::queue::{self, RenewLeaseOutcome};
use idemstage_persistence::PgPool;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::stats::WorkerStats;
use crate::telemetry;

/// The jobs held and the keeper's schedule; cloned handles share it.
#[derive(Clone)]
pub(super) struct Leases {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// A job was added that is due before the keeper's next round.
    earlier: Notify,
}

#[derive(Default)]
struct State {
    held: HashMap<(JobId, i32), Held>,
    /// When the keeper wakes next (`None`: it waits for a job).
    next_round: Option<Instant>,
}

struct Held {
    /// A third of the job's lease (as the single-job renewal did), at least 10 ms.
    every: Duration,
    due: Instant,
    lost: CancellationToken,
    /// The job's queue, for the metrics.
    queue: Arc<str>,
}

/// Most tokens per renewal statement.
const RENEW_CHUNK: usize = 1000;

/// One held job's lease, renewed until this is dropped.
pub(super) struct HeldLease {
    shared: Arc<Shared>,
    key: (JobId, i32),
    lost: CancellationToken,
}

impl HeldLease {
    /// The renewal found the job taken over (its lease had run out).
    pub(super) fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Resolves once the job is found taken over.
    pub(super) async fn lost(&self) {
        self.lost.cancelled().await
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        lock(&self.shared).held.remove(&self.key);
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // The state stays consistent whatever panicked while holding it.
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Leases {
    /// Starts the keeper; it runs until `stop`.
    pub(super) fn start(
        pool: PgPool,
        stats: Arc<WorkerStats>,
        backoff_min: Duration,
        backoff_max: Duration,
        stop: CancellationToken,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let leases = Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                earlier: Notify::new(),
            }),
        };
        let keeper = tokio::spawn(keep_leases(
            pool,
            stats,
            leases.shared.clone(),
            backoff_min,
            backoff_max,
            stop,
        ));
        (leases, keeper)
    }

    /// Holds the leases of `jobs`, just fetched: each is renewed at a third of its
    /// lease from now, until its `HeldLease` is dropped.
    pub(super) fn hold(&self, jobs: &[FetchedJob]) -> Vec<HeldLease> {
        let now = Instant::now();
        let mut st = lock(&self.shared);
        let mut earliest: Option<Instant> = None;
        let held = jobs
            .iter()
            .map(|j| {
                let every = (j.expire_in / 3).max(Duration::from_millis(10));
                let due = now + every;
                earliest = Some(earliest.map_or(due, |e| e.min(due)));
                let lost = CancellationToken::new();
                let key = (j.id, j.attempt);
                st.held.insert(
                    key,
                    Held {
                        every,
                        due,
                        lost: lost.clone(),
                        queue: Arc::from(j.queue.as_str()),
                    },
                );
                HeldLease {
                    shared: self.shared.clone(),
                    key,
                    lost,
                }
            })
            .collect();
        if let Some(due) = earliest {
            if st.next_round.is_none_or(|next| due < next) {
                self.shared.earlier.notify_one();
            }
        }
        held
    }
}

/// Sleeps until the earliest job is due, then renews, in one statement per
/// `RENEW_CHUNK`, every job due within half its renewal interval: each lease is
/// renewed at between a sixth and a third of its length, and neighbours share a
/// statement. A database error leaves the leases as they are, retried after a
/// backoff (the lease has slack); only a fenced renewal tells the holder to stop.
async fn keep_leases(
    pool: PgPool,
    stats: Arc<WorkerStats>,
    shared: Arc<Shared>,
    backoff_min: Duration,
    backoff_max: Duration,
    stop: CancellationToken,
) {
    let mut backoff = backoff_min;
    loop {
        let next = {
            let mut st = lock(&shared);
            st.next_round = st.held.values().map(|h| h.due).min();
            st.next_round
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = shared.earlier.notified() => continue,
            _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {}
        }
        let now = Instant::now();
        let due: Vec<(JobId, i32)> = lock(&shared)
            .held
            .iter()
            .filter(|(_, h)| h.due <= now + h.every / 2)
            .map(|(k, _)| *k)
            .collect();
        for chunk in due.chunks(RENEW_CHUNK) {
            let renewed = async {
                let mut conn = idemstage_persistence::get(&pool).await?;
                queue::renew_leases(&mut conn, chunk).await
            }
            .await;
            let mut st = lock(&shared);
            match renewed {
                Ok(outcomes) => {
                    backoff = backoff_min;
                    for (key, outcome) in chunk.iter().zip(outcomes) {
                        // Gone meanwhile: its holder finished, nothing to tell.
                        let Some(h) = st.held.get_mut(key) else {
                            continue;
                        };
                        match outcome {
                            RenewLeaseOutcome::Renewed { .. } => {
                                h.due = now + h.every;
                                telemetry::count_job_renewal(&h.queue, "renewed");
                            }
                            RenewLeaseOutcome::Fenced => {
                                h.lost.cancel();
                                // After the holder was told: whoever reads the
                                // count knows the job will not (or no longer) run.
                                WorkerStats::add(&stats.leases_lost, 1);
                                telemetry::count_job_renewal(&h.queue, "lost");
                                st.held.remove(key);
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, jobs = chunk.len(), retry_in = ?backoff, "job lease renewal failed");
                    for key in chunk {
                        if let Some(h) = st.held.get_mut(key) {
                            h.due = now + backoff.min(h.every);
                            telemetry::count_job_renewal(&h.queue, "error");
                        }
                    }
                    backoff = (backoff * 2).min(backoff_max);
                }
            }
        }
    }
}
