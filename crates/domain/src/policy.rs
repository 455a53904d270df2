//! Per-stage policies.

use std::time::Duration;

/// What happens when a finished stage is sent again with a different input hash.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InputChangePolicy {
    /// Refuse with `Rejected(InputChanged)`: a finished stage's input is immutable.
    #[default]
    Reject,
    /// Run the stage again; once the rerun succeeds, everything computed from the
    /// stage's earlier success is `stale` and runs again (recorded lineage decides
    /// what, not configuration).
    Rerun,
}

/// How a stage is claimed and retried. Default: 5 attempts, a 30 s lease renewed
/// every 10 s, a 300 s timeout, `Reject` on input change, 5 interruptions in a row
/// given back uncounted.
///
/// Built from the default with the `with_` methods (or by setting a field of a
/// default value), so that a setting added later breaks no stage (the struct is
/// `#[non_exhaustive]`):
///
/// ```
/// use std::time::Duration;
/// use idemstage::{stage::InputChangePolicy, stage::StagePolicy};
/// let policy = StagePolicy::default()
///     .with_max_attempts(3)
///     .with_timeout(Duration::from_secs(60))
///     .with_on_input_change(InputChangePolicy::Rerun);
/// assert!(policy.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagePolicy {
    /// Attempts before the run is `dead` (`Exhausted`); includes the first.
    pub max_attempts: i32,
    /// How long a claim holds without renewal. Measured on the database clock.
    pub lease: Duration,
    /// How often a running body renews its lease; must be well below `lease`.
    pub heartbeat: Duration,
    /// What a send with another input does to the finished stage.
    pub on_input_change: InputChangePolicy,
    /// A body (`prepare` and `run`) still running after this long is cancelled and
    /// counts as a failed, retryable attempt. Measured on the worker's clock.
    pub timeout: Duration,
    /// How many attempts in a row an interruption (a retryable database error:
    /// a lost connection, a timeout, a conflict) may give back without counting
    /// them against `max_attempts`; the next interrupted attempt in that row
    /// counts as failed, with its error. Bounds a failure that only looks
    /// passing, which would otherwise be retried for ever. 0: every interrupted
    /// attempt counts.
    pub max_interruptions: i32,
    /// Whether the next attempt of the same run reuses what `prepare` returned (a
    /// paid external call), checkpointed with the input hash and upstream attempt
    /// it was computed from, when its own binding is the same: after a commit
    /// that failed, a worker that died, a lease lost after `prepare`. Off for a
    /// stage whose call must be made again on every attempt. A changed input or
    /// upstream never reuses it.
    pub reuse_prepared: bool,
}

impl Default for StagePolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(10),
            on_input_change: InputChangePolicy::Reject,
            timeout: Duration::from_secs(300),
            max_interruptions: 5,
            reuse_prepared: true,
        }
    }
}

impl StagePolicy {
    /// The same, giving up after `attempts` attempts (the first included).
    pub fn with_max_attempts(mut self, attempts: i32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The same, a claim holding for `lease` without renewal.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The same, a running body renewing its lease every `heartbeat`.
    pub fn with_heartbeat(mut self, heartbeat: Duration) -> Self {
        self.heartbeat = heartbeat;
        self
    }

    /// The same, a send with another input doing what `policy` says.
    pub fn with_on_input_change(mut self, policy: InputChangePolicy) -> Self {
        self.on_input_change = policy;
        self
    }

    /// The same, cancelling a body still running after `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same, giving back at most `interruptions` interrupted attempts in a
    /// row uncounted.
    pub fn with_max_interruptions(mut self, interruptions: i32) -> Self {
        self.max_interruptions = interruptions;
        self
    }

    /// The same, reusing a checkpointed prepared value (`true`) or preparing
    /// anew on every attempt (`false`).
    pub fn with_reuse_prepared(mut self, reuse: bool) -> Self {
        self.reuse_prepared = reuse;
        self
    }

    /// Refuses (`DomainError::InvalidOption`) `max_attempts < 1`, a lease under
    /// 10 ms, a heartbeat not shorter than the lease, a zero timeout, a negative
    /// `max_interruptions`.
    pub fn validate(&self) -> Result<(), crate::DomainError> {
        use crate::DomainError::InvalidOption;
        if self.max_attempts < 1 {
            return Err(InvalidOption("max_attempts must be at least 1".into()));
        }
        if self.lease < Duration::from_millis(10) {
            return Err(InvalidOption("lease must be at least 10ms".into()));
        }
        if self.heartbeat.is_zero() || self.heartbeat >= self.lease {
            return Err(InvalidOption(
                "heartbeat must be positive and shorter than the lease".into(),
            ));
        }
        if self.timeout.is_zero() {
            return Err(InvalidOption("timeout must be positive".into()));
        }
        if self.max_interruptions < 0 {
            return Err(InvalidOption(
                "max_interruptions must not be negative".into(),
            ));
        }
        Ok(())
    }
}
