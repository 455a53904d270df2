//! Issue 29, item 5: an error that never reached the server is not a lost
//! connection.

use diesel::ExpressionMethods;
use idemstage_domain::RepoError;
use idemstage_example::schema::dateien;
use idemstage_persistence::map_diesel_error;

use super::*;

/// "error encoding message to server" is the driver refusing a statement before
/// anything was sent: the same statement fails the same way on every attempt, and
/// the connection is as good as before. It was classed `Unavailable`.
#[tokio::test]
async fn a_statement_the_driver_cannot_encode_is_a_database_error_not_unavailable() {
    let mut f = fixture().await;
    use dateien::dsl as d;
    // 11,000 rows of 6 bound columns: 66,000 bind parameters.
    let rows: Vec<_> = (0..11_000)
        .map(|i| {
            (
                d::id.eq(idemstage_domain::RowId::new().to_string()),
                d::tenant_id.eq("t1"),
                d::anfrage_id.eq(AnfrageId::new().to_string()),
                d::sha256.eq(format!("{i:064x}")),
                d::s3_key.eq("k"),
                d::size_bytes.eq(1i64),
            )
        })
        .collect();
    let err = diesel::insert_into(d::dateien)
        .values(rows)
        .execute(&mut f.conn)
        .await
        .unwrap_err();
    let mapped = map_diesel_error(err);
    assert!(
        matches!(&mapped, RepoError::Database(m) if m.contains("65,535 bind parameters")),
        "{mapped:?}"
    );
    assert!(!mapped.is_retryable());
    // The connection was never gone.
    assert_eq!(count(&mut f.conn, "SELECT 1").await, 1);
}
