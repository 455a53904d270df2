//! The classification of Diesel's errors: `From<diesel::result::Error>` for
//! [`RepoError`] and [`StageError`], so that a stage body may write `?` on a
//! query. The Diesel error is kept as the [`std::error::Error::source`].

use diesel::result::{DatabaseErrorKind, Error as DieselError};

use crate::error::{RepoError, RepoMessage, StageError};

impl From<DieselError> for RepoError {
    /// Classifies as [`map_diesel_error`] says; the Diesel error is the source.
    fn from(e: DieselError) -> Self {
        map_diesel_error(e)
    }
}

impl From<DieselError> for StageError {
    /// A [`StageError::Repo`] of the error's [`RepoError`] (see
    /// [`map_diesel_error`]): retryable when the database says "not now"
    /// (serialization failure, deadlock, timeouts, a lost connection), not
    /// otherwise (a constraint violation, bad SQL, `NotFound`). The Diesel error
    /// is the source.
    fn from(e: DieselError) -> Self {
        StageError::Repo(map_diesel_error(e))
    }
}

/// The [`RepoError`] of a Diesel error, which decides whether the caller may retry.
/// Retryable: serialization failure (40001) and deadlock are `Conflict`; lock and
/// statement timeouts and cancelled statements `Timeout`; 53xxx `Resources`; a
/// closed connection, a broken transaction manager and a server shutting down or
/// ending the session `Unavailable`. Everything else is `Database`, not
/// retryable: constraint violations, bad SQL, a statement the driver refused to
/// send (more than 65,535 bind parameters, a parameter it cannot serialize: the
/// same statement fails the same way every time, on a connection that is fine),
/// and also `NotFound` (use `.optional()` where no row is an answer).
///
/// Errors that Diesel has no kind for are recognized by PostgreSQL's English
/// message texts: with a translated `lc_messages` they come out as `Database`.
pub fn map_diesel_error(e: DieselError) -> RepoError {
    let (class, text) = classify(&e);
    class(RepoMessage::new(text).with_source(e))
}

/// The variant and the text of a Diesel error.
fn classify(e: &DieselError) -> (fn(RepoMessage) -> RepoError, String) {
    match e {
        DieselError::DatabaseError(kind, info) => match kind {
            DatabaseErrorKind::SerializationFailure => (RepoError::Conflict, info.message().into()),
            DatabaseErrorKind::ClosedConnection => (RepoError::Unavailable, info.message().into()),
            // diesel-async reports every driver error without a SQLSTATE under this
            // kind: a lost connection, but also a statement refused before sending.
            DatabaseErrorKind::UnableToSendCommand => match client_class(info.message()) {
                Client::Refused(why) => (RepoError::Database, format!("{}{why}", info.message())),
                Client::ConnectionGone => (RepoError::Unavailable, info.message().into()),
            },
            _ => match transient_class(info.message()) {
                Some(Transient::Conflict) => (RepoError::Conflict, info.message().into()),
                Some(Transient::Timeout) => (RepoError::Timeout, info.message().into()),
                Some(Transient::Resources) => (RepoError::Resources, info.message().into()),
                Some(Transient::Unavailable) => (RepoError::Unavailable, info.message().into()),
                None => (RepoError::Database, describe(e)),
            },
        },
        DieselError::BrokenTransactionManager => (RepoError::Unavailable, e.to_string()),
        _ => (RepoError::Database, describe(e)),
    }
}

/// The classes of server errors that say "not now" rather than "never".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transient {
    /// 40P01 deadlock_detected (40001 has a Diesel kind of its own).
    Conflict,
    /// 55P03 lock_not_available, 57014 query_canceled (statement or lock timeout,
    /// a cancel).
    Timeout,
    /// 53xxx insufficient_resources.
    Resources,
    /// 57P0x operator intervention (shutdown, restart, database dropped), 25P03
    /// idle-in-transaction timeout: the session is gone or going.
    Unavailable,
}

/// Classifies a server error by its message. diesel-async keeps the SQLSTATE only
/// for the kinds Diesel names (unique, foreign key, check, not null, 40001, …) and
/// drops it for the rest, so the server's fixed message texts are matched instead.
/// They are PostgreSQL's English texts: a server with a translated `lc_messages`
/// would make these errors look permanent (the job is then still retried, see
/// `PipelineWorker`).
fn transient_class(message: &str) -> Option<Transient> {
    const CLASSES: &[(&str, Transient)] = &[
        ("deadlock detected", Transient::Conflict),
        ("canceling statement due to", Transient::Timeout),
        ("could not obtain lock", Transient::Timeout),
        ("lock timeout", Transient::Timeout),
        ("out of memory", Transient::Resources),
        ("could not extend file", Transient::Resources),
        ("no space left on device", Transient::Resources),
        ("too many clients", Transient::Resources),
        ("connection slots are reserved", Transient::Resources),
        ("out of shared memory", Transient::Resources),
        ("terminating connection", Transient::Unavailable),
        ("the database system is", Transient::Unavailable),
        ("cannot connect now", Transient::Unavailable),
        ("idle-in-transaction timeout", Transient::Unavailable),
    ];
    let lower = message.to_ascii_lowercase();
    CLASSES
        .iter()
        .find(|(text, _)| lower.contains(text))
        .map(|&(_, class)| class)
}

/// What a driver error without a SQLSTATE (diesel-async's `UnableToSendCommand`)
/// says about the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Client {
    /// The driver refused this statement before sending it; the connection is
    /// fine and the same statement fails the same way again. What to add to the
    /// message (a hint, or nothing).
    Refused(&'static str),
    /// The connection is gone, or its state unknown.
    ConnectionGone,
}

/// Classifies a driver error by its text, tokio-postgres's `Display` of its
/// error kinds (the kind itself is not kept by diesel-async). Its errors about a
/// statement are deterministic; the rest (`connection closed`, `error
/// communicating with the server`, a timeout, a protocol message it could not
/// parse, diesel-async's connection task gone: `channel closed`) and any text not
/// known here are a connection that cannot be trusted any more.
fn client_class(message: &str) -> Client {
    const REFUSED: &[(&str, &str)] = &[
        (
            "error encoding message to server",
            " (refused by the driver, not sent: a statement with more than 65,535 bind \
             parameters, or a value too large for the protocol; write large row sets \
             in chunks, e.g. FencedTx::replace_children_chunked)",
        ),
        ("error serializing parameter", ""),
        ("error deserializing column", ""),
        ("invalid column", ""),
        ("parameters but got", ""),
        ("query returned an unexpected number of", ""),
    ];
    let lower = message.to_ascii_lowercase();
    REFUSED
        .iter()
        .find(|(text, _)| lower.contains(text))
        .map_or(Client::ConnectionGone, |&(_, why)| Client::Refused(why))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_messages_of_transient_errors_are_classified() {
        for (message, class) in [
            (
                "canceling statement due to lock timeout",
                Transient::Timeout,
            ),
            (
                "canceling statement due to statement timeout",
                Transient::Timeout,
            ),
            (
                "canceling statement due to user request",
                Transient::Timeout,
            ),
            (
                "could not obtain lock on row in relation \"stage_runs\"",
                Transient::Timeout,
            ),
            ("deadlock detected", Transient::Conflict),
            ("out of memory", Transient::Resources),
            ("sorry, too many clients already", Transient::Resources),
            (
                "terminating connection due to administrator command",
                Transient::Unavailable,
            ),
            (
                "the database system is shutting down",
                Transient::Unavailable,
            ),
        ] {
            assert_eq!(transient_class(message), Some(class), "{message}");
        }
        assert_eq!(
            transient_class("duplicate key value violates unique constraint"),
            None
        );
        assert_eq!(
            transient_class("invalid byte sequence for encoding \"UTF8\": 0x00"),
            None
        );
    }

    fn driver_error(message: &str) -> DieselError {
        DieselError::DatabaseError(
            DatabaseErrorKind::UnableToSendCommand,
            Box::new(message.to_owned()),
        )
    }

    /// tokio-postgres's texts of its error kinds (`Error`'s `Display`), as
    /// diesel-async passes them on: only those of a lost connection are
    /// `Unavailable`.
    #[test]
    fn driver_errors_are_unavailable_only_when_the_connection_is_gone() {
        for gone in [
            "connection closed",
            "error communicating with the server",
            "timeout waiting for server",
            "error parsing response from server",
            "unexpected message from server",
            "channel closed",
        ] {
            let mapped = map_diesel_error(driver_error(gone));
            assert!(
                matches!(mapped, RepoError::Unavailable(_)),
                "{gone}: {mapped:?}"
            );
        }
        for refused in [
            "error encoding message to server",
            "error serializing parameter 3",
            "error deserializing column 0",
            "invalid column `x`",
            "expected 2 parameters but got 3",
            "query returned an unexpected number of rows",
        ] {
            let mapped = map_diesel_error(driver_error(refused));
            assert!(
                matches!(&mapped, RepoError::Database(m) if m.starts_with(refused)),
                "{refused}: {mapped:?}"
            );
            assert!(!mapped.is_retryable());
        }
        let encode = map_diesel_error(driver_error("error encoding message to server"));
        assert!(
            encode.to_string().contains("65,535 bind parameters"),
            "{encode}"
        );
    }
}
