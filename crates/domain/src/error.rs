//! Errors per layer. Each says whether retrying the same operation can help.

use thiserror::Error;

/// Bad input, found before anything is written. Never retryable.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DomainError {
    #[error("invalid tenant id {0}: expected a slug [a-z0-9][a-z0-9_-]{{0,62}}")]
    InvalidTenantId(String),
    #[error(
        "invalid anfrage id {0}: expected a ULID (26 characters, Crockford base32, upper case)"
    )]
    InvalidAnfrageId(String),
    #[error("invalid row id {0}: expected a ULID")]
    InvalidRowId(String),
    #[error("invalid stage name {0}: expected [a-z][a-z0-9_]{{0,62}}")]
    InvalidStageName(String),
    #[error("unknown stage {0:?}")]
    UnknownStage(String),
    #[error("input is empty")]
    EmptyInput,
    #[error("input is {size} bytes, more than the limit of {max} bytes")]
    InputTooLarge { size: usize, max: usize },
    #[error("invalid job payload: {0}")]
    InvalidPayload(String),
    #[error("invalid option: {0}")]
    InvalidOption(String),
}

/// Errors of the persistence layer.
#[derive(Debug, Error, Clone)]
pub enum RepoError {
    /// The database cannot be reached, or the connection broke. Retry after a backoff.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// Serialization failure (40001) or deadlock (40P01) that outlived our own retries.
    #[error("transaction conflict, retry: {0}")]
    Conflict(String),
    /// The outcome of a COMMIT is unknown and could not be re-checked yet.
    #[error("commit outcome unknown: {0}")]
    AmbiguousCommit(String),
    /// The anfrage does not exist for this tenant (it may exist for another tenant).
    #[error("anfrage {anfrage} not found for tenant {tenant}")]
    AnfrageNotFound { tenant: String, anfrage: String },
    /// The anfrage id is already registered for another tenant.
    #[error("anfrage {anfrage} belongs to another tenant than {tenant}")]
    TenantMismatch { tenant: String, anfrage: String },
    /// Insert-or-get found neither its own insert nor an existing row, repeatedly.
    #[error("insert-or-get of {what} gave up after {tries} tries: the row kept disappearing")]
    InsertOrGetExhausted { what: String, tries: u32 },
    #[error(transparent)]
    Invalid(#[from] DomainError),
    /// Anything else the database refused (constraint, bad SQL): a bug or bad data.
    #[error("database error: {0}")]
    Database(String),
}

impl RepoError {
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            RepoError::Unavailable(_) | RepoError::Conflict(_) | RepoError::AmbiguousCommit(_)
        )
    }
}

/// Errors of a stage body.
#[derive(Debug, Error)]
pub enum StageError {
    /// The input cannot be processed; retrying will not help.
    #[error("permanent failure: {0}")]
    Permanent(String),
    /// A passing problem (a flaky dependency, an injected crash); retry.
    #[error("transient failure: {0}")]
    Transient(String),
    #[error("invalid input: {0}")]
    Invalid(#[from] DomainError),
    #[error(transparent)]
    Repo(#[from] RepoError),
    #[error("stage body panicked: {0}")]
    Panicked(String),
    #[error("stage body exceeded its deadline of {0:?}")]
    TimedOut(std::time::Duration),
}

impl StageError {
    pub fn is_retryable(&self) -> bool {
        match self {
            StageError::Permanent(_) | StageError::Invalid(_) => false,
            StageError::Repo(e) => e.is_retryable(),
            StageError::Transient(_) | StageError::Panicked(_) | StageError::TimedOut(_) => true,
        }
    }
}
