//! The example's checked-in Diesel schema (`src/schema.rs`) describes what its own
//! migrations create, on top of the core's, and each of its tables is under the
//! core's tenant isolation.

use idemstage_testkit::schema::{assert_schema_rs_matches, assert_tenant_isolated};

#[tokio::test]
async fn the_checked_in_schema_matches_the_migrations_and_every_table_is_isolated() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let tables = assert_schema_rs_matches(&mut conn, include_str!("../src/schema.rs")).await;
    assert_eq!(
        tables,
        [
            "anfrage_extraktionen",
            "calculation_results",
            "dateien",
            "feasibility_results"
        ]
    );
    for table in &tables {
        assert_tenant_isolated(&mut conn, table).await;
    }
}
