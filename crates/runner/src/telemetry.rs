//! The workers' metrics, recorded through the [`metrics`] facade: a no-op until
//! the binary installs a recorder (`idemstage worker --metrics-listen ADDR` installs
//! a Prometheus one; a team's own binary may install any `metrics` recorder). The
//! stage executions' metrics are [`idemstage_stage::telemetry`]'s.
//!
//! Labels are low-cardinality: the queue (a stage's queue is its name), an
//! outcome, a state. Never a tenant or an item: a label per tenant would make a
//! series per tenant and queue, without bound, in every worker.

use idemstage_persistence::queue::QueueDepth;

/// Counter: jobs fetched (leased), by `queue`.
pub const JOBS_FETCHED: &str = "idemstage_jobs_fetched_total";
/// Counter: jobs completed (by the completer, or in the stage's own fenced
/// transaction), by `queue`.
pub const JOBS_COMPLETED: &str = "idemstage_jobs_completed_total";
/// Counter: job failures with retries left (back in the queue after the job's
/// delay), by `queue`.
pub const JOBS_RETRIED: &str = "idemstage_jobs_retried_total";
/// Counter: jobs failed for good (retries used up, or a permanent error), by `queue`.
pub const JOBS_FAILED: &str = "idemstage_jobs_failed_total";
/// Counter: jobs given back to wait (a stage held by another worker, an upstream
/// not done, a database error, a rate limit), by `queue`.
pub const JOBS_DEFERRED: &str = "idemstage_jobs_deferred_total";
/// Counter: jobs given back unfinished at shutdown, by `queue`.
pub const JOBS_RELEASED: &str = "idemstage_jobs_released_total";
/// Counter: job outcomes not recorded because the job's lease had been taken over
/// (fenced), by `queue`.
pub const JOBS_FENCED: &str = "idemstage_jobs_fenced_total";
/// Counter: fetches that failed with a database error (retried after a backoff).
pub const FETCH_ERRORS: &str = "idemstage_fetch_errors_total";
/// Counter: job lease renewals by `queue` and `outcome`: `renewed`, `lost` (the
/// job was taken over after its lease ran out: its handler is stopped) or `error`
/// (a database error; retried after a backoff).
pub const JOB_LEASE_RENEWALS: &str = "idemstage_job_lease_renewals_total";
/// Gauge: jobs of a `queue` by `state`: `ready` (fetchable now), `delayed` (due
/// later: deferred, backing off, scheduled), `active` (leased). Sampled from the
/// database (see `QueueWorkerConfig::queue_gauges_interval`).
pub const QUEUE_DEPTH: &str = "idemstage_queue_depth";
/// Gauge, seconds: how long the oldest ready job of a `queue` has been due (0
/// when none is ready). Sampled with [`QUEUE_DEPTH`].
pub const QUEUE_OLDEST_READY_AGE: &str = "idemstage_queue_oldest_ready_age_seconds";

/// Describes every metric of the workers and the executor to the installed
/// recorder (help texts and units); call it once after installing one.
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, Unit};
    idemstage_stage::telemetry::describe();
    describe_counter!(JOBS_FETCHED, "Jobs fetched (leased), by queue");
    describe_counter!(JOBS_COMPLETED, "Jobs completed, by queue");
    describe_counter!(
        JOBS_RETRIED,
        "Job failures with retries left (the job is retried), by queue"
    );
    describe_counter!(JOBS_FAILED, "Jobs failed for good, by queue");
    describe_counter!(
        JOBS_DEFERRED,
        "Jobs given back to wait (stage held elsewhere, upstream not done, database error, rate limit), by queue"
    );
    describe_counter!(
        JOBS_RELEASED,
        "Jobs given back unfinished at shutdown, by queue"
    );
    describe_counter!(
        JOBS_FENCED,
        "Job outcomes not recorded because the lease had been taken over, by queue"
    );
    describe_counter!(FETCH_ERRORS, "Fetches failed with a database error");
    describe_counter!(
        JOB_LEASE_RENEWALS,
        "Job lease renewals by queue and outcome (renewed, lost, error)"
    );
    describe_gauge!(
        QUEUE_DEPTH,
        "Jobs by queue and state (ready, delayed, active), sampled from the database"
    );
    describe_gauge!(
        QUEUE_OLDEST_READY_AGE,
        Unit::Seconds,
        "How long the oldest ready job of a queue has been due, sampled from the database"
    );
}

/// Adds `n` to the per-queue counter `name`.
pub(crate) fn count_job(name: &'static str, queue: &str, n: u64) {
    if n > 0 {
        metrics::counter!(name, "queue" => queue.to_owned()).increment(n);
    }
}

/// Adds one to the per-queue counter `name` for each of `queues`, one call per run
/// of the same queue: a batch is mostly of one queue, and each call builds its
/// label.
pub(crate) fn count_jobs<'a>(name: &'static str, queues: impl IntoIterator<Item = &'a str>) {
    let mut run: Option<(&str, u64)> = None;
    for queue in queues {
        match &mut run {
            Some((current, n)) if *current == queue => *n += 1,
            _ => {
                if let Some((current, n)) = run {
                    count_job(name, current, n);
                }
                run = Some((queue, 1));
            }
        }
    }
    if let Some((current, n)) = run {
        count_job(name, current, n);
    }
}

/// Counts one job lease renewal of `queue` (`renewed`, `lost`, `error`).
pub(crate) fn count_job_renewal(queue: &str, outcome: &'static str) {
    metrics::counter!(JOB_LEASE_RENEWALS, "queue" => queue.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// Sets the queue gauges from one sample.
pub(crate) fn set_queue_gauges(depths: &[QueueDepth]) {
    for d in depths {
        for (state, n) in [
            ("ready", d.ready),
            ("delayed", d.delayed),
            ("active", d.active),
        ] {
            metrics::gauge!(QUEUE_DEPTH, "queue" => d.queue.clone(), "state" => state)
                .set(n as f64);
        }
        metrics::gauge!(QUEUE_OLDEST_READY_AGE, "queue" => d.queue.clone()).set(d.oldest_ready_s);
    }
}
