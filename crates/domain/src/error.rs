//! Errors per layer. Each says whether retrying the same operation can help.

use thiserror::Error;

/// Bad input, found before anything is written. Never retryable.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DomainError {
    /// A tenant id that is not a slug.
    #[error("invalid tenant id {0}: expected a slug [a-z0-9][a-z0-9_-]{{0,62}}")]
    InvalidTenantId(String),
    /// An anfrage id that is not a canonical ULID.
    #[error(
        "invalid anfrage id {0}: expected a ULID (26 characters, Crockford base32, upper case)"
    )]
    InvalidAnfrageId(String),
    /// A run, job or row id that is not a canonical ULID.
    #[error("invalid row id {0}: expected a ULID")]
    InvalidRowId(String),
    /// A stage name outside `[a-z][a-z0-9_]{0,62}`.
    #[error("invalid stage name {0}: expected [a-z][a-z0-9_]{{0,62}}")]
    InvalidStageName(String),
    /// A name (a queue, a stage) that is not a stage of the pipeline.
    #[error("unknown stage {0:?}")]
    UnknownStage(String),
    /// An anfrage input that is empty or only whitespace.
    #[error("input is empty")]
    EmptyInput,
    /// An anfrage input above the limit (1 MiB).
    #[error("input is {size} bytes, more than the limit of {max} bytes")]
    InputTooLarge {
        /// The input's size in bytes.
        size: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// An anfrage input holding a NUL character: valid UTF-8, but not text
    /// PostgreSQL can store.
    #[error("input is not valid text: it holds a NUL byte at byte {at}, which PostgreSQL text cannot store")]
    InputContainsNul {
        /// The offset of the first NUL, in bytes.
        at: usize,
    },
    /// A job payload that is not a valid stage job (the text says why).
    #[error("invalid job payload: {0}")]
    InvalidPayload(String),
    /// A setting out of its range (a policy, send options, a run status name).
    #[error("invalid option: {0}")]
    InvalidOption(String),
}

/// Errors of the persistence layer. [`RepoError::is_retryable`] says which may
/// succeed on a retry, [`RepoError::is_bad_request`] which never will.
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
    AnfrageNotFound {
        /// The tenant asked for.
        tenant: String,
        /// The anfrage id asked for.
        anfrage: String,
    },
    /// The anfrage id is already registered for another tenant.
    #[error("anfrage {anfrage} belongs to another tenant than {tenant}")]
    TenantMismatch {
        /// The tenant asked for (not the owner).
        tenant: String,
        /// The anfrage id.
        anfrage: String,
    },
    /// A lock or statement timeout, or a cancelled statement (55P03, 57014): the
    /// database is busy, not the request wrong. Retry after a backoff.
    #[error("database busy, retry: {0}")]
    Timeout(String),
    /// The server is out of a resource (53xxx: disk, memory, connections). Retry
    /// after a backoff.
    #[error("database out of resources, retry: {0}")]
    Resources(String),
    /// The anfrage is registered with another input and its first stage's policy
    /// is `Reject`: nothing was changed.
    #[error("anfrage {anfrage} of tenant {tenant} is registered with another input (stored sha256 {stored_hash}, new {new_hash}) and its first stage rejects input changes")]
    InputChanged {
        /// The anfrage's tenant.
        tenant: String,
        /// The anfrage id.
        anfrage: String,
        /// SHA-256 (hex) of the stored input.
        stored_hash: String,
        /// SHA-256 (hex) of the input refused.
        new_hash: String,
    },
    /// The input a run is bound to (by hash) is stored neither as the anfrage's
    /// input nor among its replaced inputs: written around the library, or older
    /// than the kept inputs. Permanent: no attempt can read it.
    #[error("anfrage {anfrage} of tenant {tenant}: the input its run is bound to (sha256 {input_hash}) is not stored")]
    BoundInputMissing {
        /// The tenant.
        tenant: String,
        /// The anfrage.
        anfrage: String,
        /// The hash the run is bound to.
        input_hash: String,
    },
    /// Insert-or-get found neither its own insert nor an existing row, repeatedly.
    #[error("insert-or-get of {what} gave up after {tries} tries: the row kept disappearing")]
    InsertOrGetExhausted {
        /// The kind of row (for the message).
        what: String,
        /// The tries made.
        tries: u32,
    },
    /// Bad input found before anything was written; never retryable.
    #[error(transparent)]
    Invalid(#[from] DomainError),
    /// Anything else the database refused (constraint, bad SQL): a bug or bad data.
    #[error("database error: {0}")]
    Database(String),
}

impl RepoError {
    /// Errors that say the request itself is wrong (no such anfrage, another
    /// tenant's, invalid ids or options, an input that may not change). Every
    /// other error is about the database, not the request.
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            RepoError::AnfrageNotFound { .. }
                | RepoError::TenantMismatch { .. }
                | RepoError::InputChanged { .. }
                | RepoError::Invalid(_)
        )
    }

    /// Errors about the database's state at the moment (unavailable, conflict,
    /// ambiguous commit, timeout, resources): the same call may succeed after a
    /// backoff.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            RepoError::Unavailable(_)
                | RepoError::Conflict(_)
                | RepoError::AmbiguousCommit(_)
                | RepoError::Timeout(_)
                | RepoError::Resources(_)
        )
    }
}

/// Errors of a stage body. [`StageError::is_retryable`] decides whether the
/// attempt counts as `failed` (claimable again within `max_attempts`) or ends the
/// run `dead` at once.
#[derive(Debug, Error)]
pub enum StageError {
    /// The input cannot be processed; retrying will not help.
    #[error("permanent failure: {0}")]
    Permanent(String),
    /// A passing problem (a flaky dependency, an injected crash); retry.
    #[error("transient failure: {0}")]
    Transient(String),
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
}

impl StageError {
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
            | StageError::RateLimited { .. } => true,
        }
    }
}

/// The most bytes of error text written to the database (`last_error`, attempt
/// history).
pub const MAX_ERROR_TEXT_BYTES: usize = 4000;

/// Error text that the database always accepts: NUL characters (which PostgreSQL's
/// `text` refuses, 22021) become U+FFFD, and text longer than
/// `MAX_ERROR_TEXT_BYTES` is cut at a character boundary with a note of its length.
/// Recording a failure must never fail because of the failure's own message.
pub fn sanitize_error_text(error: &str) -> String {
    let clean = if error.contains('\0') {
        std::borrow::Cow::Owned(error.replace('\0', "\u{fffd}"))
    } else {
        std::borrow::Cow::Borrowed(error)
    };
    if clean.len() <= MAX_ERROR_TEXT_BYTES {
        return clean.into_owned();
    }
    let mut end = MAX_ERROR_TEXT_BYTES;
    while !clean.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &clean[..end], error.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitized_error_text_has_no_nul_and_is_bounded() {
        assert_eq!(sanitize_error_text("a\0b"), "a\u{fffd}b");
        let long = "ä".repeat(5000);
        let s = sanitize_error_text(&long);
        assert!(s.len() < MAX_ERROR_TEXT_BYTES + 40, "{}", s.len());
        assert!(s.ends_with("(10000 bytes)"));
        assert_eq!(sanitize_error_text("plain"), "plain");
    }
}
