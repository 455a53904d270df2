//! What one stage execution ended in.

use idemstage_domain::{RejectReason, RunId, SkipReason};
use serde::Serialize;

use crate::StageFlow;

/// What one execution ended in. Every variant is a normal result; only a repository
/// failure that left the outcome unknown is an `Err`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ExecutionOutcome {
    /// The body ran and its writes committed with `status = 'success'`.
    Succeeded {
        /// The run (`stage_runs` row) of this (tenant, item, stage).
        run_id: RunId,
        /// The attempt that succeeded (1 for the first), now the run's `success_attempt`.
        attempt: i32,
        /// What the body returned: whether the next stage's job was sent.
        flow: StageFlow,
        /// The queue job (`run_and_complete_job`) was completed in the same transaction.
        job_completed: bool,
    },
    /// Nothing was claimed and nothing ran: the stage is done, held by another
    /// worker, or its upstream has no current success yet (see [`SkipReason`]).
    Skipped(SkipReason),
    /// The claim refused the job's input and bound nothing (see [`RejectReason`]).
    Rejected(RejectReason),
    /// This worker lost its lease before it could commit; nothing of it was written.
    Fenced {
        /// This worker's attempt, the one that was fenced.
        attempt: i32,
    },
    /// The upstream attempt this one read stopped being current before it could
    /// commit (the upstream succeeded again; for the first stage, the item's
    /// input was replaced): nothing was written, the run is `stale` and runs again
    /// on the new upstream.
    UpstreamChanged {
        /// This worker's attempt, the one that became stale.
        attempt: i32,
    },
    /// A database error (timeout, lost connection, conflict, out of resources)
    /// interrupted the attempt before it committed. Not the stage's failure: the
    /// claim was given back and the attempt does not count against `max_attempts`,
    /// up to the policy's `max_interruptions` attempts in a row; the next one
    /// interrupted in that row is `Failed` with the error.
    Interrupted {
        /// The attempt that was given back.
        attempt: i32,
        /// The database error, as text.
        error: String,
    },
    /// The body said a service it calls is rate limited
    /// ([`StageError::RateLimited`](idemstage_domain::StageError::RateLimited)): the claim was given back uncounted and the
    /// stage's bucket is held for `retry_after`.
    RateLimited {
        /// The attempt that was given back.
        attempt: i32,
        /// How long the service asked to wait.
        retry_after: std::time::Duration,
    },
    /// The body failed; the run is `failed` (claimable again) or, if `dead`, final.
    Failed {
        /// The attempt that failed.
        attempt: i32,
        /// The body's error, as recorded in `last_error` (sanitised there).
        error: String,
        /// The run is `dead`: the error was permanent or `max_attempts` is used up.
        dead: bool,
    },
    /// The body waits for a signal or a timer ([`StageError::Wait`](idemstage_domain::StageError::Wait)): the run
    /// is `waiting` (not counted, nothing written, no lease); the signal's
    /// delivery or the deadline sends its job again.
    Waiting {
        /// The attempt that ended in the wait.
        attempt: i32,
        /// The wait's deadline (database clock).
        until: chrono::DateTime<chrono::Utc>,
    },
    /// `max_attempts` reached before this claim: the run is `dead`, nothing ran.
    Exhausted {
        /// The attempts the run used.
        attempts: i32,
    },
}
