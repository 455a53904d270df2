//! Layer 2: the job queue on `jobs`.
//!
//! Every function takes the caller's connection, so that it can run inside the
//! caller's transaction (a send is then visible, and its NOTIFY fires, only on
//! commit). A fetch leases a job by appending a claim to `job_claims` (its
//! attempt, its deadline) and leaves the job's row alone; every state change of
//! a fetched job is fenced on `(id, attempt)` being the job's current claim
//! (`finish.rs`): each fetch claims a new attempt, so a worker whose lease was
//! taken over cannot complete, fail or release the job.
//!
//! Lifecycle (as `job_states` shows it; `active` is a job with a current
//! claim): `created -> active -> completed | cancelled | retry -> active ... | failed`.

mod aging;
mod batched;
mod buckets;
mod changes;
mod controls;
mod defer;
mod depth;
mod fetch;
mod finish;
mod floors;
mod listen;
mod maintenance;
mod notifier;
mod send;

pub use aging::{set_priority_aging, MAX_PRIORITY_AGING};
pub use batched::{complete_many, renew_leases, retry_now_many};
pub use buckets::{held_until, hold};
pub use changes::{control_changes, ControlChange, ControlChangeKind};
pub use controls::{
    controls, pause, resume, set_limits, Limits, PauseOutcome, QueueControl, Rate, ResumeOutcome,
    Scope,
};
pub use defer::retry_after;
pub use depth::{queue_depths, QueueDepth};
pub use fetch::{fetch, fetch_wait, fetch_with_commit, LeaseCommit};
pub use finish::{cancel, complete, fail, renew_lease, retry_at, retry_now, RenewLeaseOutcome};
pub use floors::{advance_floors, FloorMark, WALK_BELOW_EVERY};
pub use listen::JobListener;
pub use maintenance::{
    maintain, queue_stats, MaintenanceConfig, MaintenanceOutcome, MaintenanceReport,
    MAINTENANCE_LOCK_KEY,
};
pub use notifier::{Notifier, Wake};
pub use send::{send, send_batch, send_in, send_in_waking, NOTIFY_CHANNEL};

// The statement texts, for `crate::statements`.
pub(crate) use batched::{COMPLETE_MANY_SQL, RENEW_LEASES_SQL, RETRY_NOW_MANY_SQL};
pub(crate) use buckets::HOLD_SQL;
pub(crate) use defer::RETRY_AFTER_SQL;
pub(crate) use fetch::{FETCH_ASYNC_COMMIT_SQL, FETCH_SQL, FETCH_WAIT_SQL};
pub(crate) use finish::{
    complete_pipelined, CANCEL_SQL, COMPLETE_SQL, FAIL_SQL, RENEW_LEASE_SQL, RETRY_AT_SQL,
};
pub(crate) use floors::ADVANCE_FLOORS_SQL;
pub(crate) use maintenance::{EXPIRE_SQL, EXPIRY_CANDIDATES_SQL};
pub(crate) use notifier::NOTIFY_QUEUES_SQL;
pub(crate) use send::send_pipelined;
pub(crate) use send::{SEND_BATCH_SQL, SEND_SQL_NOTIFYING, SEND_SQL_QUIET};

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Retry delay in milliseconds of the job row `j`, from its values *before* the
/// failure is recorded (`j.retry_count` = retries used so far). Without backoff it
/// is `retry_delay_ms`. With backoff it is drawn uniformly from `[d/2, d]`, where
/// `d = min(retry_delay_max_ms, retry_delay_ms * 2^retry_count)` ("equal jitter":
/// workers that failed together do not retry together, and the cap holds). The
/// exponent and the result are clamped so that no value overflows a timestamp.
const RETRY_DELAY_MS_SQL: &str = "\
least(
    CASE WHEN j.retry_backoff
         THEN least(coalesce(j.retry_delay_max_ms::float8, 'Infinity'::float8),
                    j.retry_delay_ms * power(2::float8, least(j.retry_count, 40)))
              * (0.5 + random() / 2)
         ELSE least(coalesce(j.retry_delay_max_ms, j.retry_delay_ms), j.retry_delay_ms)::float8
    END,
    315360000000::float8)";

/// Dead-letter queue names must pass the `jobs.queue` CHECK (this is its expression,
/// with `{col}` for the column); a row written by hand with a bad name is failed
/// without a copy rather than making every retry of the failure (and maintenance)
/// error out.
const VALID_QUEUE_SQL: &str = "({col} ~ '^[A-Za-z0-9_.:-]+$' AND length({col}) <= 100)";
