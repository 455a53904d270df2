//! Schema drift: a crate's checked-in Diesel `schema.rs` (from `diesel
//! print-schema`) against what its migrations really create, and whether its
//! tables are under the core's tenant isolation (`idemstage_tenant_table`).
//!
//! ```no_run
//! # async fn t(db: idemstage_testkit::TestDb) {
//! let mut conn = db.conn().await;
//! let tables = idemstage_testkit::schema::assert_schema_rs_matches(
//!     &mut conn,
//!     "diesel::table! {\n    ocr_pages (id) {\n        id -> Text,\n    }\n}\n",
//! )
//! .await;
//! for table in &tables {
//!     idemstage_testkit::schema::assert_tenant_isolated(&mut conn, table).await;
//! }
//! # }
//! ```

use std::collections::BTreeMap;

use diesel::sql_types::{Bool, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

/// One table as `schema.rs` writes it: primary key columns and `(column, Diesel
/// type)` in order, e.g. `("quantity", "Nullable<Float8>")`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableShape {
    /// The primary key's columns, in key order.
    pub primary_key: Vec<String>,
    /// Every column with its Diesel SQL type, in table order.
    pub columns: Vec<(String, String)>,
}

/// The tables of a `schema.rs` source (its `diesel::table!` blocks), by name.
pub fn parse_schema_rs(src: &str) -> BTreeMap<String, TableShape> {
    let mut out = BTreeMap::new();
    let mut lines = src.lines().map(str::trim);
    while let Some(line) = lines.next() {
        if line != "diesel::table! {" {
            continue;
        }
        let header = lines.next().expect("a table! block names its table");
        let (name, rest) = header
            .split_once(" (")
            .unwrap_or_else(|| panic!("schema.rs: cannot read the table header {header:?}"));
        let primary_key = rest
            .trim_end_matches(") {")
            .split(", ")
            .map(str::to_owned)
            .collect();
        let columns = lines
            .by_ref()
            .take_while(|l| *l != "}")
            .map(|l| {
                let (c, ty) = l
                    .trim_end_matches(',')
                    .split_once(" -> ")
                    .unwrap_or_else(|| panic!("schema.rs: cannot read the column {l:?}"));
                (c.to_owned(), ty.to_owned())
            })
            .collect();
        out.insert(
            name.to_owned(),
            TableShape {
                primary_key,
                columns,
            },
        );
    }
    out
}

#[derive(diesel::QueryableByName)]
struct ColumnRow {
    #[diesel(sql_type = Text)]
    column_name: String,
    #[diesel(sql_type = Text)]
    sql_type: String,
    #[diesel(sql_type = Bool)]
    not_null: bool,
    #[diesel(sql_type = Text)]
    pk: String,
}

/// The table `public.<table>` as the database has it, in `schema.rs` terms; `None`
/// if there is no such table. A domain (`ulid_text`, `tenant_slug`) reads as its
/// base type, as `diesel print-schema` writes it.
pub async fn migrated_table(conn: &mut AsyncPgConnection, table: &str) -> Option<TableShape> {
    let rows: Vec<ColumnRow> = diesel::sql_query(
        "SELECT a.attname::text AS column_name,
                format_type(coalesce(nullif(t.typbasetype, 0), t.oid), NULL) AS sql_type,
                a.attnotnull AS not_null,
                coalesce((SELECT string_agg(k.attname, ', ' ORDER BY array_position(i.indkey, k.attnum))
                   FROM pg_index i JOIN pg_attribute k
                     ON k.attrelid = i.indrelid AND k.attnum = ANY (i.indkey)
                  WHERE i.indrelid = c.oid AND i.indisprimary), '')::text AS pk
           FROM pg_class c
           JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public'
           JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
           JOIN pg_type t ON t.oid = a.atttypid
          WHERE c.relname = $1 AND c.relkind IN ('r', 'p')
          ORDER BY a.attnum",
    )
    .bind::<Text, _>(table)
    .load(conn)
    .await
    .expect("read the table's columns from pg_catalog");
    let first = <[ColumnRow]>::first(&rows)?;
    Some(TableShape {
        primary_key: first.pk.split(", ").map(str::to_owned).collect(),
        columns: rows
            .iter()
            .map(|r| (r.column_name.clone(), diesel_type(&r.sql_type, r.not_null)))
            .collect(),
    })
}

/// Asserts that every table of the `schema.rs` source exists in the database
/// with the same primary key, columns in order, types and nullability; returns
/// the tables' names. Regenerate `schema.rs` with `diesel print-schema` when it
/// fails. (Whether the database has tables that `schema.rs` lacks is the caller's
/// question: it knows which tables are its own.)
pub async fn assert_schema_rs_matches(
    conn: &mut AsyncPgConnection,
    schema_rs: &str,
) -> Vec<String> {
    let checked_in = parse_schema_rs(schema_rs);
    assert!(!checked_in.is_empty(), "schema.rs has no table! block");
    for (table, shape) in &checked_in {
        let migrated = migrated_table(conn, table)
            .await
            .unwrap_or_else(|| panic!("table {table} is in schema.rs but not in the migrations"));
        assert_eq!(shape, &migrated, "schema.rs vs the migrated table {table}");
    }
    checked_in.into_keys().collect()
}

/// Asserts that `table` is under the core's tenant isolation as
/// `idemstage_tenant_table` sets it up: row-level security enabled and forced, and
/// the policy `tenant_isolation`.
pub async fn assert_tenant_isolated(conn: &mut AsyncPgConnection, table: &str) {
    #[derive(diesel::QueryableByName)]
    struct Isolated {
        #[diesel(sql_type = Bool)]
        isolated: bool,
    }
    let row: Option<Isolated> = diesel::sql_query(
        "SELECT c.relrowsecurity AND c.relforcerowsecurity AND EXISTS (
                    SELECT 1 FROM pg_policy p
                     WHERE p.polrelid = c.oid AND p.polname = 'tenant_isolation') AS isolated
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = 'public' AND c.relname = $1",
    )
    .bind::<Text, _>(table)
    .get_result(conn)
    .await
    .ok();
    assert!(
        row.is_some_and(|r| r.isolated),
        "table {table} is not under tenant isolation (SELECT idemstage_tenant_table('{table}'))"
    );
}

fn diesel_type(sql: &str, not_null: bool) -> String {
    // An array's elements may be NULL whatever the column says.
    if let Some(element) = sql.strip_suffix("[]") {
        let base = format!("Array<{}>", diesel_type(element, false));
        return if not_null {
            base
        } else {
            format!("Nullable<{base}>")
        };
    }
    let base = match sql {
        "text" => "Text",
        "integer" => "Int4",
        "bigint" => "Int8",
        "smallint" => "Int2",
        "boolean" => "Bool",
        "jsonb" => "Jsonb",
        "bytea" => "Bytea",
        "double precision" => "Float8",
        "real" => "Float4",
        "timestamp with time zone" => "Timestamptz",
        "timestamp without time zone" => "Timestamp",
        "date" => "Date",
        "uuid" => "Uuid",
        other => panic!("schema drift check does not know the SQL type {other}"),
    };
    if not_null {
        base.to_owned()
    } else {
        format!("Nullable<{base}>")
    }
}
