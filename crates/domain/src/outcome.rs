//! Outcomes of conditional writes: small enums, never a bare bool.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{DomainError, RunId};

/// `stage_runs.status`. Documented in the first migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// A worker holds the lease until `lease_expires_at`.
    Running,
    /// Final: the stage's results are committed (fenced by `attempts`).
    Success,
    /// The last attempt failed; claimable again while `attempts < max_attempts`.
    Failed,
    /// Final: failed for good (`max_attempts` used up, or a permanent error);
    /// never claimed again.
    Dead,
    /// Its upstream succeeded again (or its input was replaced): its results are
    /// outdated, and it is claimable again with a fresh budget.
    Stale,
    /// Final: an operator cancelled the item before the stage was final
    /// (`idemstage cancel`); never claimed again, and a running attempt is fenced.
    Cancelled,
    /// Its last attempt ended in a wait ([`WaitFor`](crate::WaitFor)) for a
    /// signal or a timer: nobody holds it and it has no job; the signal, or the
    /// wait's deadline, makes it claimable again (or `dead`).
    Waiting,
}

impl RunStatus {
    /// Every status.
    pub const ALL: [RunStatus; 7] = [
        RunStatus::Running,
        RunStatus::Success,
        RunStatus::Failed,
        RunStatus::Dead,
        RunStatus::Stale,
        RunStatus::Cancelled,
        RunStatus::Waiting,
    ];
    /// The status as stored in `stage_runs.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Success => "success",
            RunStatus::Failed => "failed",
            RunStatus::Dead => "dead",
            RunStatus::Stale => "stale",
            RunStatus::Cancelled => "cancelled",
            RunStatus::Waiting => "waiting",
        }
    }

    /// Whether the status is final: `success`, `dead` or `cancelled` (no claim
    /// changes it, except a rerun of a success on new input).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            RunStatus::Success | RunStatus::Dead | RunStatus::Cancelled
        )
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RunStatus {
    type Err = DomainError;
    fn from_str(s: &str) -> Result<Self, DomainError> {
        RunStatus::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| DomainError::InvalidOption(format!("unknown run status {s:?}")))
    }
}

/// Why a claim ran nothing. Not an error: the stage is done, or another worker or
/// stage has to act first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum SkipReason {
    /// The stage succeeded before (with the same input): nothing to do, ever.
    AlreadySucceeded {
        /// The run that succeeded.
        run_id: RunId,
    },
    /// Another worker holds a live lease on it.
    InFlight {
        /// When that lease runs out (database clock).
        lease_expires_at: DateTime<Utc>,
    },
    /// The stage before this one has no current successful attempt (it has not
    /// run, is running for the first time, failed or died): this stage has nothing
    /// to read yet and is not run. Deferred, never failed: the upstream's success
    /// sends this stage's job.
    UpstreamNotDone {
        /// The stage before this one.
        upstream: crate::StageName,
        /// The upstream's status, `None` if it has no run yet.
        status: Option<RunStatus>,
        /// The upstream's lease end while it is `running`.
        lease_expires_at: Option<DateTime<Utc>>,
    },
    /// An operator cancelled the stage (`idemstage cancel`): final, nothing to do,
    /// ever.
    Cancelled {
        /// The cancelled run.
        run_id: RunId,
    },
    /// The stage waits for a signal or a timer: the signal's delivery, or the
    /// wait's deadline, sends its job again.
    Waiting {
        /// The waiting run.
        run_id: RunId,
    },
    /// The item is a child of a fan-out that a rerun of its parent replaced:
    /// nothing of it runs any more.
    Superseded,
    /// A gather whose fan-out has children that are not final yet: the child
    /// that completes it sends the gather's job.
    ChildrenNotFinal {
        /// Children final so far.
        final_children: i32,
        /// Children of the fan-out.
        children: i32,
    },
}

/// Why a claim refused a job's input and bound nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum RejectReason {
    /// The stage succeeded with another input and its policy is `Reject`.
    /// Permanent for this job.
    InputChanged {
        /// The hash the stage succeeded on.
        stored_hash: String,
        /// The hash of the refused input.
        new_hash: String,
    },
    /// The job's `input_hash` is not the item's stored input hash (a crafted or
    /// outdated job): nothing was bound. The claim binds only hashes the database
    /// computed.
    InputMismatch {
        /// The hash the job carried.
        job_hash: String,
        /// The item's stored input hash.
        stored_hash: String,
    },
}

/// The result of one claim statement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ClaimOutcome {
    /// This worker now holds the lease; `attempt` is its fencing token.
    Claimed {
        /// The run claimed.
        run_id: RunId,
        /// The attempt number, 1 for the first.
        attempt: i32,
        /// When the lease runs out unless renewed (database clock).
        lease_expires_at: DateTime<Utc>,
        /// The input hash this attempt is bound to, as the database has it: the
        /// item's stored input for the first stage, the upstream's successful
        /// attempt's for the others.
        input_hash: String,
        /// The upstream's successful attempt this attempt reads (`None` for the
        /// first stage); its fenced commit checks it is still current.
        upstream_attempt: Option<i32>,
    },
    /// Nothing claimed; see [`SkipReason`].
    Skipped(SkipReason),
    /// The input was refused; see [`RejectReason`].
    Rejected(RejectReason),
    /// `max_attempts` reached: the run is `dead` and will not be claimed again.
    Exhausted {
        /// The attempts the run used.
        attempts: i32,
    },
}

/// The result of a fenced completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum CompleteOutcome {
    /// The results and `status = 'success'` committed together.
    Committed,
    /// The lease was taken over (`attempts` moved on): nothing was written.
    Fenced,
    /// The upstream attempt this one read is no longer the upstream's current
    /// success (or, for the first stage, the item's stored input changed):
    /// nothing of the stage was written, the run is `stale` and runs again on the
    /// new upstream.
    UpstreamChanged,
}

/// The result of recording a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FailOutcome {
    /// `status = 'failed'`; the stage may be claimed again.
    WillRetry {
        /// The attempt that failed.
        attempt: i32,
    },
    /// `status = 'dead'`; `max_attempts` used up, or the error was permanent.
    Exhausted {
        /// The attempts the run used.
        attempts: i32,
    },
    /// The lease was taken over; the failure was not recorded on the run.
    Fenced,
}

/// The result of renewing a run's lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RenewOutcome {
    /// The lease is extended.
    Renewed {
        /// The new end of the lease (database clock).
        lease_expires_at: DateTime<Utc>,
    },
    /// The lease was taken over: this attempt can no longer commit.
    Fenced,
}
