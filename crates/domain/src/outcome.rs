//! Outcomes of conditional writes: small enums, never a bare bool.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{DomainError, RunId};

/// `pipeline_runs.status`. Documented in the first migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Running,
    Success,
    Failed,
    Dead,
    Stale,
}

impl RunStatus {
    pub const ALL: [RunStatus; 5] = [
        RunStatus::Running,
        RunStatus::Success,
        RunStatus::Failed,
        RunStatus::Dead,
        RunStatus::Stale,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Success => "success",
            RunStatus::Failed => "failed",
            RunStatus::Dead => "dead",
            RunStatus::Stale => "stale",
        }
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

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum SkipReason {
    /// The stage succeeded before (with the same input): nothing to do, ever.
    AlreadySucceeded { run_id: RunId },
    /// Another worker holds a live lease on it.
    InFlight { lease_expires_at: DateTime<Utc> },
    /// The stage before this one has no current successful attempt (it has not
    /// run, is running for the first time, failed or died): this stage has nothing
    /// to read yet and is not run. Deferred, never failed: the upstream's success
    /// sends this stage's job.
    UpstreamNotDone {
        upstream: crate::StageName,
        /// The upstream's status, `None` if it has no run yet.
        status: Option<RunStatus>,
        /// The upstream's lease end while it is `running`.
        lease_expires_at: Option<DateTime<Utc>>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum RejectReason {
    /// The stage succeeded with another input and its policy is `Reject`.
    InputChanged {
        stored_hash: String,
        new_hash: String,
    },
    /// The job's `input_hash` is not the anfrage's stored input hash (a crafted or
    /// outdated job): nothing was bound. The claim binds only hashes the database
    /// computed.
    InputMismatch {
        job_hash: String,
        stored_hash: String,
    },
}

/// The result of one claim statement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ClaimOutcome {
    /// This worker now holds the lease; `attempt` is its fencing token.
    Claimed {
        run_id: RunId,
        attempt: i32,
        lease_expires_at: DateTime<Utc>,
        /// The input hash this attempt is bound to, as the database has it: the
        /// anfrage's stored input for the first stage, the upstream's successful
        /// attempt's for the others.
        input_hash: String,
        /// The upstream's successful attempt this attempt reads (`None` for the
        /// first stage); its fenced commit checks it is still current.
        upstream_attempt: Option<i32>,
    },
    Skipped(SkipReason),
    Rejected(RejectReason),
    /// `max_attempts` reached: the run is `dead` and will not be claimed again.
    Exhausted {
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
    /// success (or, for the first stage, the anfrage's stored input changed):
    /// nothing of the stage was written, the run is `stale` and runs again on the
    /// new upstream.
    UpstreamChanged,
}

/// The result of recording a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FailOutcome {
    /// `status = 'failed'`; the stage may be claimed again.
    WillRetry { attempt: i32 },
    /// `status = 'dead'`; `max_attempts` used up.
    Exhausted { attempts: i32 },
    /// The lease was taken over; the failure was not recorded on the run.
    Fenced,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RenewOutcome {
    Renewed { lease_expires_at: DateTime<Utc> },
    Fenced,
}
