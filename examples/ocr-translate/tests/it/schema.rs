//! The checked-in Diesel schema (`src/schema.rs`) describes what the migrations
//! create, and the migrations put both tables under the core's tenant isolation.

use idemstage_testkit::schema::{assert_schema_rs_matches, assert_tenant_isolated};

use crate::support::*;

#[tokio::test]
async fn the_checked_in_schema_matches_the_migrations_and_both_tables_are_isolated() {
    let mut f = fixture().await;
    let tables = assert_schema_rs_matches(&mut f.conn, include_str!("../../src/schema.rs")).await;
    assert_eq!(tables, ["ocr_pages", "translations"]);
    for table in &tables {
        assert_tenant_isolated(&mut f.conn, table).await;
    }
}
