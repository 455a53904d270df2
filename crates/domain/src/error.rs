//! Errors per layer. Each says whether retrying the same operation can help.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use thiserror::Error;

mod stage;
pub use stage::{BoxError, StageError};

/// Bad input, found before anything is written. Never retryable.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DomainError {
    /// A tenant id that is not a slug.
    #[error("invalid tenant id {0}: expected a slug [a-z0-9][a-z0-9_-]{{0,62}}")]
    InvalidTenantId(String),
    /// An item id that is not a canonical ULID.
    #[error("invalid item id {0}: expected a ULID (26 characters, Crockford base32, upper case)")]
    InvalidItemId(String),
    /// A run, job or row id that is not a canonical ULID.
    #[error("invalid row id {0}: expected a ULID")]
    InvalidRowId(String),
    /// A stage name outside `[a-z][a-z0-9_]{0,62}`.
    #[error("invalid stage name {0}: expected [a-z][a-z0-9_]{{0,62}}")]
    InvalidStageName(String),
    /// A name (a queue, a stage) that is not a stage of the pipeline.
    #[error("unknown stage {0:?}")]
    UnknownStage(String),
    /// An item input that is empty or only whitespace.
    #[error("input is empty")]
    EmptyInput,
    /// An item input above the limit (1 MiB).
    #[error("input is {size} bytes, more than the limit of {max} bytes")]
    InputTooLarge {
        /// The input's size in bytes.
        size: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// An item input holding a NUL character: valid UTF-8, but not text
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
    /// A fan-out's children are refused (too many, a key empty, too long or
    /// twice): the fan-out stage's attempt fails permanently.
    #[error("invalid fan-out: {0}")]
    InvalidFanOut(String),
}

/// The text of a [`RepoError`], with the error it came from if there is one (a
/// Diesel error, say): that error is the `RepoError`'s
/// [`source`](std::error::Error::source).
///
/// Made from a `String` or `&str` (`RepoError::Database(text.into())`); reads as
/// a `str` (it derefs to one, compares with one, displays as its text).
#[derive(Clone, Default)]
pub struct RepoMessage {
    text: String,
    source: Option<Arc<dyn StdError + Send + Sync + 'static>>,
}

impl RepoMessage {
    /// A text without a source.
    pub fn new(text: impl Into<String>) -> Self {
        RepoMessage {
            text: text.into(),
            source: None,
        }
    }

    /// The same text, with `source` as the error it came from.
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The error this one came from, if it was kept.
    pub fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }

    /// The text, the source dropped.
    pub fn into_string(self) -> String {
        self.text
    }
}

impl std::ops::Deref for RepoMessage {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

impl AsRef<str> for RepoMessage {
    fn as_ref(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for RepoMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for RepoMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            None => fmt::Debug::fmt(&self.text, f),
            Some(source) => f
                .debug_struct("RepoMessage")
                .field("text", &self.text)
                .field("source", source)
                .finish(),
        }
    }
}

impl From<String> for RepoMessage {
    fn from(text: String) -> Self {
        RepoMessage::new(text)
    }
}

impl From<&str> for RepoMessage {
    fn from(text: &str) -> Self {
        RepoMessage::new(text)
    }
}

impl From<RepoMessage> for String {
    fn from(message: RepoMessage) -> Self {
        message.text
    }
}

impl PartialEq for RepoMessage {
    /// Compares the texts only.
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl PartialEq<str> for RepoMessage {
    fn eq(&self, other: &str) -> bool {
        self.text == other
    }
}

impl PartialEq<&str> for RepoMessage {
    fn eq(&self, other: &&str) -> bool {
        self.text == *other
    }
}

impl PartialEq<String> for RepoMessage {
    fn eq(&self, other: &String) -> bool {
        &self.text == other
    }
}

/// Errors of the persistence layer. [`RepoError::is_retryable`] says which may
/// succeed on a retry, [`RepoError::is_bad_request`] which never will.
///
/// A Diesel error converts into one (`?`, or [`map_diesel_error`]),
/// classified by what the database said, and stays reachable as the
/// [`source`](std::error::Error::source).
#[derive(Debug, Clone)]
pub enum RepoError {
    /// The database cannot be reached, or the connection broke. Retry after a backoff.
    Unavailable(RepoMessage),
    /// Serialization failure (40001) or deadlock (40P01) that outlived our own retries.
    Conflict(RepoMessage),
    /// The outcome of a COMMIT is unknown and could not be re-checked yet.
    AmbiguousCommit(RepoMessage),
    /// The item does not exist for this tenant (it may exist for another tenant).
    ItemNotFound {
        /// The tenant asked for.
        tenant: String,
        /// The item id asked for.
        item: String,
    },
    /// The item id is already registered for another tenant.
    TenantMismatch {
        /// The tenant asked for (not the owner).
        tenant: String,
        /// The item id.
        item: String,
    },
    /// A lock or statement timeout, or a cancelled statement (55P03, 57014): the
    /// database is busy, not the request wrong. Retry after a backoff.
    Timeout(RepoMessage),
    /// The server is out of a resource (53xxx: disk, memory, connections). Retry
    /// after a backoff.
    Resources(RepoMessage),
    /// The item is registered with another input and its first stage's policy
    /// is `Reject`: nothing was changed.
    InputChanged {
        /// The item's tenant.
        tenant: String,
        /// The item id.
        item: String,
        /// SHA-256 (hex) of the stored input.
        stored_hash: String,
        /// SHA-256 (hex) of the input refused.
        new_hash: String,
    },
    /// The input a run is bound to (by hash) is stored neither as the item's
    /// input nor among its replaced inputs: written around the library, or older
    /// than the kept inputs. Permanent: no attempt can read it.
    BoundInputMissing {
        /// The tenant.
        tenant: String,
        /// The item.
        item: String,
        /// The hash the run is bound to.
        input_hash: String,
    },
    /// Insert-or-get found neither its own insert nor an existing row, repeatedly.
    InsertOrGetExhausted {
        /// The kind of row (for the message).
        what: String,
        /// The tries made.
        tries: u32,
    },
    /// Bad input found before anything was written; never retryable.
    Invalid(DomainError),
    /// Anything else the database refused (constraint, bad SQL): a bug or bad data.
    Database(RepoMessage),
}

impl fmt::Display for RepoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RepoError::Unavailable(m) => write!(f, "database unavailable: {m}"),
            RepoError::Conflict(m) => write!(f, "transaction conflict, retry: {m}"),
            RepoError::AmbiguousCommit(m) => write!(f, "commit outcome unknown: {m}"),
            RepoError::ItemNotFound { tenant, item } => {
                write!(f, "item {item} not found for tenant {tenant}")
            }
            RepoError::TenantMismatch { tenant, item } => {
                write!(f, "item {item} belongs to another tenant than {tenant}")
            }
            RepoError::Timeout(m) => write!(f, "database busy, retry: {m}"),
            RepoError::Resources(m) => write!(f, "database out of resources, retry: {m}"),
            RepoError::InputChanged {
                tenant,
                item,
                stored_hash,
                new_hash,
            } => write!(
                f,
                "item {item} of tenant {tenant} is registered with another input \
                 (stored sha256 {stored_hash}, new {new_hash}) and its first stage rejects \
                 input changes"
            ),
            RepoError::BoundInputMissing {
                tenant,
                item,
                input_hash,
            } => write!(
                f,
                "item {item} of tenant {tenant}: the input its run is bound to \
                 (sha256 {input_hash}) is not stored"
            ),
            RepoError::InsertOrGetExhausted { what, tries } => write!(
                f,
                "insert-or-get of {what} gave up after {tries} tries: the row kept disappearing"
            ),
            RepoError::Invalid(e) => fmt::Display::fmt(e, f),
            RepoError::Database(m) => write!(f, "database error: {m}"),
        }
    }
}

impl StdError for RepoError {
    /// The error the text came from (a Diesel error, converted with `?` or
    /// `map_diesel_error`), if it was kept.
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            RepoError::Invalid(e) => e.source(),
            other => other.message().and_then(RepoMessage::source),
        }
    }
}

impl From<DomainError> for RepoError {
    fn from(e: DomainError) -> Self {
        RepoError::Invalid(e)
    }
}

impl RepoError {
    /// Errors that say the request itself is wrong (no such item, another
    /// tenant's, invalid ids or options, an input that may not change). Every
    /// other error is about the database, not the request.
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            RepoError::ItemNotFound { .. }
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

    /// The text (and the source it came from) of a variant that has one:
    /// `Unavailable`, `Conflict`, `AmbiguousCommit`, `Timeout`, `Resources`,
    /// `Database`.
    pub fn message(&self) -> Option<&RepoMessage> {
        match self {
            RepoError::Unavailable(m)
            | RepoError::Conflict(m)
            | RepoError::AmbiguousCommit(m)
            | RepoError::Timeout(m)
            | RepoError::Resources(m)
            | RepoError::Database(m) => Some(m),
            _ => None,
        }
    }
}

pub use crate::diesel_error::map_diesel_error;

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
