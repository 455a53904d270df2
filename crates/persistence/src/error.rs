//! The transaction error type of the persistence layer. The classification of
//! Diesel's errors lives in the domain crate (`From<diesel::result::Error>` for
//! `RepoError` and `StageError`); [`map_diesel_error`] is that conversion.

use diesel::result::Error as DieselError;
pub use idemstage_domain::error::map_diesel_error;
use idemstage_domain::{RepoError, RepoMessage, StageError};

/// The error type of a transaction that mixes Diesel calls, repository helpers and a
/// stage body (diesel-async's `transaction` needs `From<diesel::result::Error>`).
#[derive(Debug)]
pub enum TxError {
    /// A Diesel error of a statement, or of BEGIN/COMMIT; classified by
    /// [`map_diesel_error`] when converted.
    Diesel(DieselError),
    /// An error of a repository helper, already classified.
    Repo(RepoError),
    /// The stage body's own error, passed through unchanged.
    Stage(StageError),
}

impl From<DieselError> for TxError {
    fn from(e: DieselError) -> Self {
        TxError::Diesel(e)
    }
}

impl From<RepoError> for TxError {
    fn from(e: RepoError) -> Self {
        TxError::Repo(e)
    }
}

impl From<StageError> for TxError {
    fn from(e: StageError) -> Self {
        TxError::Stage(e)
    }
}

impl From<TxError> for StageError {
    fn from(e: TxError) -> Self {
        match e {
            TxError::Diesel(e) => StageError::Repo(map_diesel_error(e)),
            TxError::Repo(e) => StageError::Repo(e),
            TxError::Stage(e) => e,
        }
    }
}

impl TxError {
    /// The [`RepoError`], for transactions without a stage body. A `Stage` error
    /// that is not a repository error becomes `Database` with its message.
    pub fn into_repo(self) -> RepoError {
        match StageError::from(self) {
            StageError::Repo(e) => e,
            other => RepoError::Database(RepoMessage::new(other.to_string()).with_source(other)),
        }
    }
}
