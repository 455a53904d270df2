//! Issue 29, item 6: roles that can get around row-level security, as a worker's
//! login role would: told apart by `check_worker_role`, and unable to run their
//! code as the tables' owner through the SECURITY DEFINER control-change trigger.

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use idemstage_domain::ItemId;
use idemstage_persistence::roles::{check_worker_role, RoleCheck};
use idemstage_testkit::{TEST_OPERATOR, TEST_WORKER};

use crate::support::*;
/// A login role of this test's own in `group` (roles are per server: a unique
/// name, its password its name, as the testkit's), with `attributes`.
pub(super) async fn login_role(
    admin: &mut AsyncPgConnection,
    group: &str,
    attributes: &str,
) -> String {
    let name = format!("idemstage_t_{}", ItemId::new().to_string().to_lowercase());
    admin
        .batch_execute(&format!(
            "CREATE ROLE {name} LOGIN PASSWORD '{name}' {attributes} IN ROLE {group}"
        ))
        .await
        .unwrap();
    name
}

/// Drops the roles of [`login_role`] and what they own in this database (the
/// database itself given back to the admin first).
pub(super) async fn drop_login_roles(admin: &mut AsyncPgConnection, roles: &[String]) {
    for role in roles {
        admin
            .batch_execute(&format!(
                "DO $$ BEGIN
                     IF EXISTS (SELECT FROM pg_database WHERE datname = current_database()
                                 AND datdba = '{role}'::regrole) THEN
                         EXECUTE format('ALTER DATABASE %I OWNER TO CURRENT_USER',
                                        current_database());
                     END IF;
                 END $$;
                 DROP OWNED BY {role}; DROP ROLE {role};"
            ))
            .await
            .unwrap();
    }
}

async fn checked(db: &idemstage_testkit::TestDb, role: &str) -> RoleCheck {
    let url = idemstage_testkit::url_with_user(db.url(), role);
    let mut conn = idemstage_persistence::connect(&url).await.unwrap();
    check_worker_role(&mut conn).await.unwrap()
}

/// Issue 29, item 6: a login role that can make itself (or its code) the
/// tables' owner is not `Restricted`: CREATEROLE, the database's owner, the
/// schema's owner, CREATE on the schema. Before, all four were `Restricted`.
#[tokio::test]
async fn roles_that_can_make_themselves_the_owner_are_told_apart() {
    let db = idemstage_testkit::TestDb::new().await;
    let mut admin = db.conn().await;
    let createrole = login_role(&mut admin, "idemstage_worker", "CREATEROLE").await;
    let db_owner = login_role(&mut admin, "idemstage_worker", "").await;
    let schema_owner = login_role(&mut admin, "idemstage_worker", "").await;
    let creator = login_role(&mut admin, "idemstage_worker", "").await;
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I OWNER TO {db_owner}', current_database()); END $$;
             GRANT CREATE ON SCHEMA public TO {creator};"
        ))
        .await
        .unwrap();
    let name: String = {
        #[derive(diesel::QueryableByName)]
        struct Db {
            #[diesel(sql_type = diesel::sql_types::Text)]
            name: String,
        }
        diesel_async::RunQueryDsl::get_result::<Db>(
            diesel::sql_query("SELECT current_database()::text AS name"),
            &mut admin,
        )
        .await
        .unwrap()
        .name
    };

    let check = checked(&db, &createrole).await;
    assert_eq!(
        check,
        RoleCheck::CreateRole {
            role: createrole.clone()
        }
    );
    assert!(check.to_string().contains("CREATEROLE"), "{check}");
    let check = checked(&db, &db_owner).await;
    assert_eq!(
        check,
        RoleCheck::OwnsDatabase {
            role: db_owner.clone(),
            database: name
        }
    );
    assert!(check.to_string().contains("database"), "{check}");
    let check = checked(&db, &creator).await;
    assert_eq!(
        check,
        RoleCheck::CreateOnSchema {
            role: creator.clone(),
            schema: "public".into()
        }
    );
    assert!(
        check.to_string().contains("REVOKE CREATE ON SCHEMA public"),
        "{check}"
    );
    // The schema's owner (not the database's): the database back to the admin.
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I OWNER TO CURRENT_USER', current_database()); END $$;
             ALTER SCHEMA public OWNER TO {schema_owner};"
        ))
        .await
        .unwrap();
    let check = checked(&db, &schema_owner).await;
    admin
        .batch_execute("ALTER SCHEMA public OWNER TO pg_database_owner")
        .await
        .unwrap();
    assert_eq!(
        check,
        RoleCheck::OwnsSchema {
            role: schema_owner.clone(),
            schema: "public".into()
        }
    );
    // The test's own worker role still is what a worker should run as.
    assert!(checked(&db, TEST_WORKER).await.is_restricted());
    drop_login_roles(&mut admin, &[createrole, db_owner, schema_owner, creator]).await;
}

/// Issue 29, item 6: the escalation through the SECURITY DEFINER control-change
/// trigger. A worker login role that owns the database (and so the schema
/// `public`) replaces `public.idemstage_actor_tag()`, which an earlier trigger
/// called unqualified as the tables' owner, with code that switches row-level
/// security off; an operator's `pause` then ran it as the owner. Now the trigger
/// calls nothing outside `pg_catalog`, so the code runs only as the operator
/// whose own statement calls it (the owner never); and a record table replaced
/// by that role (with a trigger of its own) makes the change fail instead.
#[tokio::test]
async fn a_database_owner_cannot_run_its_code_as_the_tables_owner_through_a_control_change() {
    use idemstage_persistence::queue::{pause, resume, Scope};
    let db = idemstage_testkit::TestDb::new().await;
    let mut admin = db.conn().await;
    new_item(&mut admin, &tenant("tb")).await;
    let evil = login_role(&mut admin, "idemstage_worker", "").await;
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I OWNER TO {evil}', current_database()); END $$;"
        ))
        .await
        .unwrap();
    let mut e = idemstage_persistence::connect(&idemstage_testkit::url_with_user(db.url(), &evil))
        .await
        .unwrap();
    assert!(matches!(
        check_worker_role(&mut e).await.unwrap(),
        RoleCheck::OwnsDatabase { .. }
    ));
    // What runs: switch FORCE off on items if it may, and say as whom it ran.
    e.batch_execute(
        "CREATE TABLE public.loot (who text, forced boolean);
         GRANT ALL ON public.loot TO PUBLIC;
         CREATE FUNCTION public.attack() RETURNS void LANGUAGE plpgsql AS $f$
         BEGIN
             BEGIN
                 EXECUTE 'ALTER TABLE public.items NO FORCE ROW LEVEL SECURITY';
             EXCEPTION WHEN insufficient_privilege THEN NULL;
             END;
             INSERT INTO public.loot
             SELECT current_user, relforcerowsecurity FROM pg_class WHERE relname = 'items';
         END $f$;
         GRANT EXECUTE ON FUNCTION public.attack() TO PUBLIC;
         DROP FUNCTION public.idemstage_actor_tag();
         CREATE FUNCTION public.idemstage_actor_tag() RETURNS text LANGUAGE plpgsql AS $f$
         BEGIN
             PERFORM public.attack();
             RETURN (extract(epoch FROM statement_timestamp()) * 1000000)::bigint::text || ':';
         END $f$;",
    )
    .await
    .unwrap();
    let mut op = idemstage_persistence::connect(&db.operator_url())
        .await
        .unwrap();
    let actor = crate::controls::test_actor();
    pause(&mut op, "intake", &Scope::Queue, &actor)
        .await
        .unwrap();
    let not_operator = format!("SELECT 1 FROM loot WHERE who <> '{TEST_OPERATOR}'");
    assert_eq!(
        count(&mut admin, &not_operator).await,
        0,
        "ran as the owner"
    );
    let forced = "SELECT 1 FROM pg_class WHERE relname = 'items' AND relforcerowsecurity";
    assert_eq!(count(&mut admin, forced).await, 1);
    // Recorded as before, with the operator's actor.
    let changes = idemstage_persistence::queue::control_changes(&mut op, Some("intake"), 10)
        .await
        .unwrap();
    assert_eq!(changes[0].actor.as_deref(), Some("test"), "{changes:?}");

    // The record replaced by a table of that role, whose trigger runs the code:
    // the change is refused, the code never runs as the owner.
    e.batch_execute(
        "DROP TABLE public.queue_control_changes;
         CREATE TABLE public.queue_control_changes (
             id bigint GENERATED ALWAYS AS IDENTITY, changed_at timestamptz, queue text,
             scope text, change text, paused boolean, max_active integer,
             rate_count integer, rate_period_ms bigint, rate_burst integer,
             weight integer, actor text, db_user text);
         GRANT ALL ON public.queue_control_changes TO PUBLIC;
         CREATE FUNCTION public.record() RETURNS trigger LANGUAGE plpgsql AS $f$
         BEGIN PERFORM public.attack(); RETURN NEW; END $f$;
         CREATE TRIGGER record BEFORE INSERT ON public.queue_control_changes
             FOR EACH ROW EXECUTE FUNCTION public.record();",
    )
    .await
    .unwrap();
    let refused = resume(&mut op, "intake", &Scope::Queue, &actor)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("not owned by"), "{refused}");
    assert_eq!(
        count(&mut admin, &not_operator).await,
        0,
        "ran as the owner"
    );
    assert_eq!(count(&mut admin, forced).await, 1);
    drop((e, op));
    drop_login_roles(&mut admin, &[evil]).await;
}
