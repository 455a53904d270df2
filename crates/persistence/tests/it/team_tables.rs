//! A team's own table under the same tenant isolation as ours by one line of its
//! migration, `SELECT idemstage_tenant_table('ocr_pages')` (the baseline migration):
//! a transaction scoped to one tenant (`tenant::scope`) can neither read, update,
//! delete nor insert another tenant's rows, and one without a tenant sees nothing.

use diesel::sql_types::{Bool, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::TenantId;
use idemstage_persistence::tenant::scope;
use idemstage_testkit::TestDb;

use crate::support::*;

/// The team's table, as its migration would create it.
const OCR_PAGES: &str = "CREATE TABLE ocr_pages (id text PRIMARY KEY, \
     tenant_id text NOT NULL, item_id text NOT NULL, page int NOT NULL, text text NOT NULL)";

/// The one line of the team's migration.
const PROTECT: &str = "SELECT idemstage_tenant_table('ocr_pages')";

async fn team_table(conn: &mut AsyncPgConnection) {
    conn.batch_execute(OCR_PAGES).await.unwrap();
    conn.batch_execute(PROTECT).await.unwrap();
}

async fn insert_page(
    conn: &mut AsyncPgConnection,
    id: &str,
    tenant: &str,
) -> Result<usize, diesel::result::Error> {
    diesel::sql_query(
        "INSERT INTO ocr_pages (id, tenant_id, item_id, page, text) \
         VALUES ($1, $2, '01JDQ3W5AAAAAAAAAAAAAAAAAA', 1, 'Seite 1')",
    )
    .bind::<Text, _>(id)
    .bind::<Text, _>(tenant)
    .execute(conn)
    .await
}

/// Inserts `id` for `tenant` in a transaction scoped to `scoped_to`.
async fn insert_scoped(
    conn: &mut AsyncPgConnection,
    scoped_to: &TenantId,
    id: &str,
    tenant: &str,
) -> Result<usize, diesel::result::Error> {
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        scope(conn, scoped_to).await?;
        insert_page(conn, id, tenant).await
    })
    .await
}

#[derive(diesel::QueryableByName, Debug, PartialEq)]
struct Flags {
    #[diesel(sql_type = Bool)]
    enabled: bool,
    #[diesel(sql_type = Bool)]
    forced: bool,
    #[diesel(sql_type = Bool)]
    granted: bool,
}

/// RLS enabled, forced, and SELECT/INSERT/UPDATE/DELETE granted to idemstage_app.
async fn flags(conn: &mut AsyncPgConnection, table: &str) -> Flags {
    diesel::sql_query(
        "SELECT relrowsecurity AS enabled, relforcerowsecurity AS forced, \
                has_table_privilege('idemstage_app', oid, 'SELECT, INSERT, UPDATE, DELETE') \
                AS granted \
         FROM pg_class WHERE oid = $1::regclass",
    )
    .bind::<Text, _>(table)
    .get_result(conn)
    .await
    .unwrap()
}

#[derive(diesel::QueryableByName, Debug, PartialEq)]
struct Policy {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Text)]
    shape: String,
    #[diesel(sql_type = Text)]
    qual: String,
    #[diesel(sql_type = Text)]
    with_check: String,
}

/// Every policy of `table`, with its roles, command and permissiveness as `shape`.
async fn policies(conn: &mut AsyncPgConnection, table: &str) -> Vec<Policy> {
    diesel::sql_query(
        "SELECT policyname::text AS name, \
                array_to_string(roles, ',') || ' ' || cmd || ' ' || permissive AS shape, \
                coalesce(qual, '') AS qual, coalesce(with_check, '') AS with_check \
         FROM pg_policies WHERE schemaname = 'public' AND tablename = $1 ORDER BY 1",
    )
    .bind::<Text, _>(table)
    .load(conn)
    .await
    .unwrap()
}

async fn n(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    count(conn, sql).await
}

/// Tenant `t1`'s scope sees, changes and deletes only its own rows of the table.
async fn assert_isolated(conn: &mut AsyncPgConnection, t1: &TenantId) {
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        scope(conn, t1).await?;
        assert!(
            n(conn, "SELECT 1 FROM ocr_pages").await > 0,
            "t1 sees its rows"
        );
        assert_eq!(
            n(conn, "SELECT 1 FROM ocr_pages WHERE tenant_id <> 't1'").await,
            0,
            "t1 sees another tenant's rows"
        );
        let touched =
            diesel::sql_query("UPDATE ocr_pages SET text = 'overwritten' WHERE tenant_id = 't2'")
                .execute(conn)
                .await?;
        assert_eq!(touched, 0, "t1 updated t2's rows");
        let deleted = diesel::sql_query("DELETE FROM ocr_pages WHERE tenant_id = 't2'")
            .execute(conn)
            .await?;
        assert_eq!(deleted, 0, "t1 deleted t2's rows");
        Ok(())
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_team_table_put_under_isolation_by_one_call_is_isolated_like_ours() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    team_table(&mut conn).await;
    let (t1, t2) = (tenant("t1"), tenant("t2"));

    // Each tenant writes its own rows in its own scope.
    assert_eq!(insert_scoped(&mut conn, &t1, "p1", "t1").await.unwrap(), 1);
    assert_eq!(insert_scoped(&mut conn, &t2, "p2", "t2").await.unwrap(), 1);
    // A row for t2 written from t1's scope is refused by the policy's WITH CHECK.
    let err = insert_scoped(&mut conn, &t1, "p3", "t2").await.unwrap_err();
    assert!(err.to_string().contains("row-level security"), "{err}");

    // t2's rows are invisible to t1 for SELECT, UPDATE and DELETE.
    assert_isolated(&mut conn, &t1).await;
    // Moving t1's row to t2 is refused too.
    let err = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            scope(conn, &t1).await?;
            diesel::sql_query("UPDATE ocr_pages SET tenant_id = 't2'")
                .execute(conn)
                .await?;
            Ok(())
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("row-level security"), "{err}");

    // The role alone, without a tenant, sees nothing and writes nothing.
    conn.batch_execute("BEGIN; SET LOCAL ROLE idemstage_app")
        .await
        .unwrap();
    assert_eq!(n(&mut conn, "SELECT 1 FROM ocr_pages").await, 0);
    conn.batch_execute("ROLLBACK").await.unwrap();
    let err = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            conn.batch_execute("SET LOCAL ROLE idemstage_app").await?;
            insert_page(conn, "p4", "t1").await
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("row-level security"), "{err}");

    // The connecting superuser sees both tenants' rows, untouched.
    assert_eq!(
        n(
            &mut conn,
            "SELECT 1 FROM ocr_pages WHERE (id, tenant_id, text) IN \
             (('p1', 't1', 'Seite 1'), ('p2', 't2', 'Seite 1'))"
        )
        .await,
        2
    );
    assert_eq!(n(&mut conn, "SELECT 1 FROM ocr_pages").await, 2);

    // Enabled and forced, granted, and the one policy shaped exactly like ours.
    assert_eq!(
        flags(&mut conn, "ocr_pages").await,
        Flags {
            enabled: true,
            forced: true,
            granted: true
        }
    );
    let ours = policies(&mut conn, "items").await;
    let theirs = policies(&mut conn, "ocr_pages").await;
    assert_eq!(theirs.len(), 1, "{theirs:?}");
    // Ours have the operator's read policy (the baseline migration) besides.
    let ours = ours
        .iter()
        .find(|p| p.name == "tenant_isolation")
        .expect("tenant_isolation on items");
    let theirs = &theirs[0];
    assert_eq!(
        (theirs.name.as_str(), theirs.shape.as_str()),
        ("tenant_isolation", "idemstage_app ALL PERMISSIVE")
    );
    assert_eq!((&theirs.name, &theirs.shape), (&ours.name, &ours.shape));
    // Ours compares a tenant_slug domain (deparsed with a cast), theirs plain text.
    let expr = "(tenant_id = current_setting('app.tenant_id'::text, true))";
    assert_eq!(
        (theirs.qual.as_str(), theirs.with_check.as_str()),
        (expr, expr)
    );
}

#[tokio::test]
async fn calling_it_twice_is_harmless_and_restores_a_changed_policy() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    team_table(&mut conn).await;
    let once = policies(&mut conn, "ocr_pages").await;
    conn.batch_execute(PROTECT).await.unwrap();
    assert_eq!(policies(&mut conn, "ocr_pages").await, once);

    // A policy of the same name loosened by hand is replaced by the canonical one.
    conn.batch_execute(
        "DROP POLICY tenant_isolation ON ocr_pages; \
         CREATE POLICY tenant_isolation ON ocr_pages TO idemstage_app USING (true)",
    )
    .await
    .unwrap();
    conn.batch_execute(PROTECT).await.unwrap();
    assert_eq!(policies(&mut conn, "ocr_pages").await, once);
    assert_eq!(
        flags(&mut conn, "ocr_pages").await,
        Flags {
            enabled: true,
            forced: true,
            granted: true
        }
    );

    let (t1, t2) = (tenant("t1"), tenant("t2"));
    insert_scoped(&mut conn, &t1, "p1", "t1").await.unwrap();
    insert_scoped(&mut conn, &t2, "p2", "t2").await.unwrap();
    assert_isolated(&mut conn, &t1).await;
    assert_eq!(n(&mut conn, "SELECT 1 FROM ocr_pages").await, 2);
}

#[tokio::test]
async fn a_relation_without_a_text_tenant_id_is_refused_by_name_and_left_unchanged() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute(
        "CREATE TABLE ocr_notes (id text PRIMARY KEY, tenant text NOT NULL); \
         CREATE TABLE ocr_counts (id text PRIMARY KEY, tenant_id int NOT NULL); \
         CREATE VIEW ocr_view AS SELECT 't1'::text AS tenant_id",
    )
    .await
    .unwrap();
    for (table, message) in [
        (
            "ocr_notes",
            "table public.ocr_notes has no tenant_id column",
        ),
        (
            "ocr_counts",
            "tenant_id of table public.ocr_counts is not text",
        ),
        ("ocr_view", "public.ocr_view is not a table"),
    ] {
        let err = conn
            .batch_execute(&format!("SELECT idemstage_tenant_table('{table}')"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains(message), "{table}: {err}");
        assert!(policies(&mut conn, table).await.is_empty(), "{table}");
        if table != "ocr_view" {
            assert_eq!(
                flags(&mut conn, table).await,
                Flags {
                    enabled: false,
                    forced: false,
                    granted: false
                },
                "{table}"
            );
        }
    }
    // An unknown table fails at the call, naming it.
    let err = conn
        .batch_execute("SELECT idemstage_tenant_table('ocr_missing')")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("\"ocr_missing\" does not exist"),
        "{err}"
    );
}

/// A team table with a serial key (`BIGSERIAL`): its sequence was not granted,
/// so a stage's first insert failed (permission denied for the sequence) and the
/// stage ended `dead`. The one line now grants the table's own sequences too.
#[tokio::test]
async fn a_team_table_with_a_serial_key_takes_inserts_in_the_scope() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute(
        "CREATE TABLE invoice_lines (id bigserial PRIMARY KEY, tenant_id text NOT NULL, \
         line int NOT NULL); SELECT idemstage_tenant_table('invoice_lines')",
    )
    .await
    .unwrap();
    let tenant = TenantId::parse("t1").unwrap();
    let inserted = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            scope(conn, &tenant).await?;
            diesel::sql_query("INSERT INTO invoice_lines (tenant_id, line) VALUES ('t1', 1)")
                .execute(conn)
                .await
        })
        .await;
    assert_eq!(inserted.map_err(|e| e.to_string()), Ok(1));
}

/// `FencedTx::insert_or_get_audited` on a team table with a serial key: the audit
/// entry names the row's id, the one returned, whether the call created the row
/// or found it.
#[tokio::test]
async fn insert_or_get_audited_records_the_id_of_the_row_it_returns() {
    use futures_util::FutureExt;
    use idemstage_domain::CompleteOutcome;
    use idemstage_persistence::{FencedTx, InsertOrGet};
    use std::sync::Mutex;

    #[derive(diesel::QueryableByName)]
    struct Entity {
        #[diesel(sql_type = Text)]
        entity_id: String,
        #[diesel(sql_type = Text)]
        action: String,
    }

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // Rows of another key first, so that the ids of ours are not 1.
    conn.batch_execute(
        "CREATE TABLE invoices (id bigserial PRIMARY KEY, tenant_id text NOT NULL, \
         number text NOT NULL, UNIQUE (tenant_id, number)); \
         SELECT idemstage_tenant_table('invoices'); \
         INSERT INTO invoices (tenant_id, number) VALUES ('t1', 'a'), ('t1', 'b'), ('t1', 'c')",
    )
    .await
    .unwrap();
    let t = tenant("t1");
    let repo = repo(&db, 2).await;
    /// The id column, as `sql_query` loads it.
    #[derive(diesel::QueryableByName, Debug, Clone, Copy, PartialEq, Eq)]
    struct Id {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        id: i64,
    }
    impl std::fmt::Display for Id {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            self.id.fmt(f)
        }
    }
    let found: std::sync::Arc<Mutex<Vec<InsertOrGet<Id>>>> = Default::default();
    fn write_fn<F>(f: F) -> F
    where
        F: for<'t> Fn(
                &'t mut FencedTx<'_>,
            ) -> futures_util::future::BoxFuture<
                't,
                Result<(), idemstage_domain::StageError>,
            > + Send
            + Sync,
    {
        f
    }
    for number in ["z", "z"] {
        let req = request(&t, new_item(&mut conn, &t).await, "extract");
        let token = token_of(&req, &repo.claim(&req).await.unwrap());
        let write = write_fn(|tx| {
            let found = found.clone();
            async move {
                let got = tx
                    .insert_or_get_audited(
                        "invoices",
                        ("invoice.created", "invoice.reused"),
                        serde_json::json!({ "number": number }),
                        || {
                            diesel::sql_query(
                                "INSERT INTO invoices (tenant_id, number) VALUES ('t1', $1) \
                                 ON CONFLICT DO NOTHING RETURNING id",
                            )
                            .bind::<Text, _>(number.to_owned())
                        },
                        || {
                            diesel::sql_query("SELECT id FROM invoices WHERE number = $1")
                                .bind::<Text, _>(number.to_owned())
                        },
                    )
                    .await?;
                found.lock().unwrap().push(got);
                Ok(())
            }
            .boxed()
        });
        assert_eq!(
            repo.complete(&token, &write).await.unwrap(),
            CompleteOutcome::Committed
        );
    }
    let found = found.lock().unwrap().clone();
    assert!(found[0].inserted && !found[1].inserted, "{found:?}");
    assert_eq!(found[0].id, found[1].id);
    assert_eq!(found[0].id.id, 4, "three rows were there before");
    let audited: Vec<Entity> = diesel::sql_query(
        "SELECT entity_id, action FROM audit_log WHERE action LIKE 'invoice.%' ORDER BY created_at, id",
    )
    .load(&mut conn)
    .await
    .unwrap();
    let audited: Vec<(String, String)> = audited
        .into_iter()
        .map(|e| (e.entity_id, e.action))
        .collect();
    assert_eq!(
        audited,
        [
            ("4".to_owned(), "invoice.created".to_owned()),
            ("4".to_owned(), "invoice.reused".to_owned())
        ]
    );
}
