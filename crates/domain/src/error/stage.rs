//! The error of a stage body, and what it says about retrying.

use thiserror::Error;

use super::{DomainError, RepoError};

/// Errors of a stage body. [`StageError::is_retryable`] decides whether the
/// attempt counts as `failed` (claimable again within `max_attempts`) or ends the
/// run `dead` at once.
#[derive(Debug, Error)]
pub enum StageError {
    /// The input cannot be processed; retrying will not help. Holds the error
    /// that said so (its `source` chain is kept); `"text".into()` or
    /// `format!(..).into()` for a message, [`StageError::permanent`] for any error.
    #[error("permanent failure: {0}")]
    Permanent(#[source] BoxError),
    /// A passing problem (a flaky dependency, an injected crash); retry. Holds the
    /// error, as `Permanent` does ([`StageError::transient`]).
    #[error("transient failure: {0}")]
    Transient(#[source] BoxError),
    /// Bad input found by the body; permanent.
    #[error("invalid input: {0}")]
    Invalid(#[from] DomainError),
    /// A database error in the body; retryable as [`RepoError::is_retryable`] says.
    /// A retryable one interrupts the attempt without counting it.
    #[error(transparent)]
    Repo(#[from] RepoError),
    /// The body panicked (the executor caught it); retryable.
    #[error("stage body panicked: {0}")]
    Panicked(String),
    /// The body ran longer than its policy's `timeout` (the duration); retryable.
    #[error("stage body exceeded its deadline of {0:?}")]
    TimedOut(std::time::Duration),
    /// A service the body calls refused for now (an HTTP 429 with Retry-After):
    /// not the stage's failure. The attempt is given back without counting, the
    /// job runs again after `retry_after`, and the stage's bucket (the tenant's,
    /// if the stage has a per-tenant rate, else the stage's) is held until then,
    /// so its other jobs wait too.
    #[error("rate limited; retry after {retry_after:?}")]
    RateLimited {
        /// How long the service asked to wait.
        retry_after: std::time::Duration,
    },
    /// Not a failure: the stage waits for a signal or a timer
    /// ([`WaitFor`](crate::WaitFor)). The attempt ends `waiting` (not counted),
    /// nothing of it is written, and the stage runs again once the wait ends.
    #[error("waiting for {}", .0.signal.as_ref().map_or("a timer".to_owned(), |s| format!("signal {s}")))]
    Wait(crate::WaitFor),
}

impl From<crate::WaitFor> for StageError {
    fn from(wait: crate::WaitFor) -> Self {
        StageError::Wait(wait)
    }
}

/// Any error that may cross threads: what [`StageError::Permanent`] and
/// [`StageError::Transient`] hold. A `String` or `&str` converts into one.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl StageError {
    /// A permanent failure caused by `error` (kept as the source).
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        StageError::Permanent(error.into())
    }

    /// A transient failure caused by `error` (kept as the source).
    pub fn transient(error: impl Into<BoxError>) -> Self {
        StageError::Transient(error.into())
    }

    /// Whether another attempt may succeed: `Transient`, `Panicked`, `TimedOut`,
    /// `RateLimited` and retryable `Repo` errors are; `Permanent` and `Invalid`
    /// are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            StageError::Permanent(_) | StageError::Invalid(_) => false,
            StageError::Repo(e) => e.is_retryable(),
            StageError::Transient(_)
            | StageError::Panicked(_)
            | StageError::TimedOut(_)
            | StageError::RateLimited { .. }
            | StageError::Wait(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_and_transient_keep_their_source_and_their_text() {
        let cause = std::io::Error::other("disk on fire");
        let e = StageError::permanent(cause);
        assert_eq!(e.to_string(), "permanent failure: disk on fire");
        let source = std::error::Error::source(&e).expect("kept");
        assert!(source.downcast_ref::<std::io::Error>().is_some());
        assert!(!e.is_retryable());
        let e = StageError::Transient("flaky".into());
        assert_eq!(e.to_string(), "transient failure: flaky");
        assert!(e.is_retryable());
    }
}
