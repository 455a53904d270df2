//! The checked-in Diesel schema (`src/schema.rs`) describes what the migrations
//! create, and the migrations put both tables under the core's tenant isolation.

use std::collections::BTreeMap;

use diesel::sql_types::{Bool, Text};
use idemstage::diesel_async::RunQueryDsl;

use crate::support::*;

/// Table -> (primary key, [(column, Diesel type)]), from `table!` blocks.
type Tables = BTreeMap<String, (String, Vec<(String, String)>)>;

fn parse_schema_rs(src: &str) -> Tables {
    let mut tables = Tables::new();
    let mut lines = src.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if line != "diesel::table! {" {
            continue;
        }
        let (name, pk) = lines.next().unwrap().split_once(" (").unwrap();
        let columns = lines
            .by_ref()
            .take_while(|l| *l != "}")
            .map(|l| {
                let (c, ty) = l.trim_end_matches(',').split_once(" -> ").unwrap();
                (c.to_owned(), ty.to_owned())
            })
            .collect();
        tables.insert(
            name.to_owned(),
            (pk.trim_end_matches(") {").to_owned(), columns),
        );
    }
    tables
}

fn diesel_type(sql: &str, not_null: bool) -> String {
    let base = match sql {
        "text" => "Text",
        "integer" => "Int4",
        "bigint" => "Int8",
        "boolean" => "Bool",
        "jsonb" => "Jsonb",
        "timestamp with time zone" => "Timestamptz",
        other => panic!("the schema test does not know the SQL type {other}"),
    };
    if not_null {
        base.to_owned()
    } else {
        format!("Nullable<{base}>")
    }
}

#[derive(diesel::QueryableByName)]
struct Column {
    #[diesel(sql_type = Text)]
    table_name: String,
    #[diesel(sql_type = Text)]
    column_name: String,
    #[diesel(sql_type = Text)]
    sql_type: String,
    #[diesel(sql_type = Bool)]
    not_null: bool,
    #[diesel(sql_type = Text)]
    pk: String,
    #[diesel(sql_type = Bool)]
    isolated: bool,
}

#[tokio::test]
async fn the_checked_in_schema_matches_the_migrations_and_both_tables_are_isolated() {
    let mut f = fixture().await;
    let columns: Vec<Column> = diesel::sql_query(
        "SELECT c.relname::text AS table_name, a.attname::text AS column_name,
                -- a domain (ulid_text, tenant_slug) as its base type
                format_type(coalesce(nullif(t.typbasetype, 0), t.oid), NULL) AS sql_type,
                a.attnotnull AS not_null,
                (SELECT string_agg(k.attname, ', ' ORDER BY array_position(i.indkey, k.attnum))
                   FROM pg_index i JOIN pg_attribute k
                     ON k.attrelid = i.indrelid AND k.attnum = ANY (i.indkey)
                  WHERE i.indrelid = c.oid AND i.indisprimary)::text AS pk,
                c.relrowsecurity AND c.relforcerowsecurity AND EXISTS (
                    SELECT 1 FROM pg_policy p
                     WHERE p.polrelid = c.oid AND p.polname = 'tenant_isolation') AS isolated
           FROM pg_class c
           JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
           JOIN pg_type t ON t.oid = a.atttypid
          WHERE c.relname IN ('ocr_pages', 'translations') AND c.relkind = 'r'
          ORDER BY c.relname, a.attnum",
    )
    .load(&mut f.conn)
    .await
    .unwrap();
    let mut migrated = Tables::new();
    for c in &columns {
        assert!(c.isolated, "{} is not under tenant isolation", c.table_name);
        migrated
            .entry(c.table_name.clone())
            .or_insert_with(|| (c.pk.clone(), Vec::new()))
            .1
            .push((c.column_name.clone(), diesel_type(&c.sql_type, c.not_null)));
    }
    let checked_in = parse_schema_rs(include_str!("../../src/schema.rs"));
    assert_eq!(checked_in, migrated);
    assert_eq!(checked_in.len(), 2);
}
