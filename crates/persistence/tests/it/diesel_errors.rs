//! `?` on a Diesel error in a stage body: the error is classified as
//! `map_diesel_error` does and keeps the Diesel error as its source.

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{RepoError, StageError};
use idemstage_testkit::TestDb;

/// What a stage body writes: `?` on the query, no `map_err`.
async fn body(conn: &mut AsyncPgConnection, sql: &str) -> Result<(), StageError> {
    diesel::sql_query(sql).execute(conn).await?;
    Ok(())
}

/// The same in a repository helper: `?` into `RepoError`.
async fn helper(conn: &mut AsyncPgConnection, sql: &str) -> Result<(), RepoError> {
    diesel::sql_query(sql).execute(conn).await?;
    Ok(())
}

fn diesel_source<'a>(e: &'a (dyn std::error::Error + 'static)) -> &'a DieselError {
    e.source()
        .and_then(|s| s.downcast_ref::<DieselError>())
        .unwrap_or_else(|| panic!("the source is not the Diesel error: {e:?}"))
}

#[tokio::test]
async fn a_unique_violation_with_question_mark_is_a_permanent_repo_error_with_its_source() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute("CREATE TABLE pages (id int PRIMARY KEY); INSERT INTO pages VALUES (1)")
        .await
        .unwrap();

    let err = body(&mut conn, "INSERT INTO pages VALUES (1)")
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StageError::Repo(RepoError::Database(m)) if m.contains("pages_pkey")),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    // The text is map_diesel_error's (with the constraint), as before.
    assert!(
        err.to_string()
            .starts_with("database error: duplicate key value violates unique constraint"),
        "{err}"
    );
    assert!(matches!(
        diesel_source(&err),
        DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)
    ));

    let err = helper(&mut conn, "INSERT INTO pages VALUES (1)")
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::Database(_)), "{err:?}");
    assert!(matches!(
        diesel_source(&err),
        DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, _)
    ));
    // map_diesel_error (kept for existing call sites) keeps the source too.
    let mapped = idemstage_persistence::map_diesel_error(DieselError::NotFound);
    assert!(matches!(diesel_source(&mapped), DieselError::NotFound));
}

#[tokio::test]
async fn a_serialization_failure_with_question_mark_is_a_retryable_conflict_with_its_source() {
    let db = TestDb::new().await;
    let mut first = db.conn().await;
    let mut second = db.conn().await;
    first
        .batch_execute(
            "CREATE TABLE pages (id int PRIMARY KEY, v int); INSERT INTO pages VALUES (1, 0)",
        )
        .await
        .unwrap();

    // The first transaction takes its snapshot, the second changes the row under
    // it: the first one's update cannot be serialized (40001).
    first
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT v FROM pages")
        .await
        .unwrap();
    second
        .batch_execute("UPDATE pages SET v = 2 WHERE id = 1")
        .await
        .unwrap();
    let err = body(&mut first, "UPDATE pages SET v = 1 WHERE id = 1")
        .await
        .unwrap_err();
    first.batch_execute("ROLLBACK").await.unwrap();

    assert!(
        matches!(&err, StageError::Repo(RepoError::Conflict(_))),
        "{err:?}"
    );
    assert!(err.is_retryable());
    assert!(matches!(
        diesel_source(&err),
        DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _)
    ));
}
