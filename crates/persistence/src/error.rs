//! Maps Diesel's errors onto the domain's `RepoError`, deciding what is retryable.

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use idemstage_domain::{RepoError, StageError};

pub fn map_diesel_error(e: DieselError) -> RepoError {
    match &e {
        DieselError::DatabaseError(kind, info) => match kind {
            DatabaseErrorKind::SerializationFailure => RepoError::Conflict(info.message().into()),
            DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand => {
                RepoError::Unavailable(info.message().into())
            }
            // Diesel has no kind for 40P01; the server's message is fixed text.
            _ if info.message().contains("deadlock detected") => {
                RepoError::Conflict(info.message().into())
            }
            // 57P01 admin_shutdown / 57P03 cannot_connect_now during a restart.
            _ if info.message().contains("terminating connection")
                || info.message().contains("the database system is") =>
            {
                RepoError::Unavailable(info.message().into())
            }
            _ => RepoError::Database(describe(&e)),
        },
        DieselError::BrokenTransactionManager => RepoError::Unavailable(e.to_string()),
        _ => RepoError::Database(describe(&e)),
    }
}

fn describe(e: &DieselError) -> String {
    match e {
        DieselError::DatabaseError(_, info) => match (info.constraint_name(), info.details()) {
            (Some(c), Some(d)) => format!("{} (constraint {c}: {d})", info.message()),
            (Some(c), None) => format!("{} (constraint {c})", info.message()),
            _ => info.message().to_owned(),
        },
        other => other.to_string(),
    }
}

/// The error type of a transaction that mixes Diesel calls, repository helpers and a
/// stage body (diesel-async's `transaction` needs `From<diesel::result::Error>`).
#[derive(Debug)]
pub enum TxError {
    Diesel(DieselError),
    Repo(RepoError),
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
    /// For transactions without a stage body.
    pub fn into_repo(self) -> RepoError {
        match StageError::from(self) {
            StageError::Repo(e) => e,
            other => RepoError::Database(other.to_string()),
        }
    }
}
