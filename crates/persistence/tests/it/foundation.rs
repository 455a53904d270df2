//! The workspace foundation: migrations, schema drift, the claim's unique index,
//! test database isolation.

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::Text;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_testkit::TestDb;

#[derive(diesel::QueryableByName, Debug)]
struct Name {
    #[diesel(sql_type = Text)]
    name: String,
}

async fn public_tables(conn: &mut AsyncPgConnection) -> Vec<String> {
    let rows: Vec<Name> = diesel::sql_query(
        "SELECT table_name::text AS name FROM information_schema.tables \
         WHERE table_schema = 'public' AND table_name <> '__diesel_schema_migrations' \
           AND table_type = 'BASE TABLE' \
         ORDER BY 1",
    )
    .load(conn)
    .await
    .unwrap();
    rows.into_iter().map(|r| r.name).collect()
}

async fn public_views(conn: &mut AsyncPgConnection) -> Vec<String> {
    let rows: Vec<Name> = diesel::sql_query(
        "SELECT table_name::text AS name FROM information_schema.views \
         WHERE table_schema = 'public' ORDER BY 1",
    )
    .load(conn)
    .await
    .unwrap();
    rows.into_iter().map(|r| r.name).collect()
}

#[tokio::test]
async fn migrations_round_trip_up_down_up() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let tables = public_tables(&mut conn).await;
    // The core's tables and nothing of a pipeline's (the example's tables are its
    // own migrations').
    assert_eq!(
        tables,
        [
            "audit_log",
            "bulk_actions",
            "fanout_children",
            "fanouts",
            "item_inputs",
            "items",
            "items_open",
            "items_open_0",
            "items_open_1",
            "items_open_2",
            "items_open_3",
            "job_claims",
            "job_closures",
            "job_expiry_mark",
            "job_keys",
            "job_lanes",
            "job_walk_mark",
            "job_windows",
            "jobs",
            "queue_buckets",
            "queue_control_changes",
            "queue_controls",
            "stage_attempt_ends",
            "stage_checkpoints",
            "stage_reruns",
            "stage_runs",
            "stage_waits"
        ]
    );
    assert_eq!(
        public_views(&mut conn).await,
        ["job_states", "stage_run_attempts"]
    );

    let reverted = idemstage_persistence::revert_all_migrations(db.url())
        .await
        .unwrap();
    assert!(reverted >= 1);
    assert_eq!(public_tables(&mut conn).await, Vec::<String>::new());
    assert_eq!(public_views(&mut conn).await, Vec::<String>::new());

    let applied = idemstage_persistence::migrate(db.url()).await.unwrap();
    assert_eq!(applied, reverted);
    assert_eq!(public_tables(&mut conn).await, tables);
    assert_eq!(
        public_views(&mut conn).await,
        ["job_states", "stage_run_attempts"]
    );
    // Applying again is a no-op.
    assert_eq!(idemstage_persistence::migrate(db.url()).await.unwrap(), 0);
}

/// A team's migrations on top of the core's go down and up again together
/// (`revert_all_with`), while the core's alone refuses to revert under them.
#[tokio::test]
async fn team_migrations_round_trip_with_the_cores() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let tables = public_tables(&mut conn).await;
    assert!(
        tables.contains(&"anfrage_extraktionen".to_owned()),
        "{tables:?}"
    );

    let err = idemstage_persistence::revert_all_migrations(db.url())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("20261201200001"), "{err}");
    assert_eq!(public_tables(&mut conn).await, tables, "nothing reverted");

    let team = || vec![idemstage_example::MIGRATIONS];
    let reverted = idemstage_persistence::revert_all_with(db.url(), team())
        .await
        .unwrap();
    assert_eq!(public_tables(&mut conn).await, Vec::<String>::new());
    let applied = idemstage_persistence::migrate_with(db.url(), team())
        .await
        .unwrap();
    assert_eq!(applied, reverted);
    assert_eq!(public_tables(&mut conn).await, tables);
}

/// A migration applied from a set that is not given (a team's, older than the
/// core's newest: a core upgrade after the team's migration) is found before
/// anything is reverted, so the schema is not left half down.
#[tokio::test]
async fn a_revert_that_meets_an_unknown_version_reverts_nothing() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let tables = public_tables(&mut conn).await;
    conn.batch_execute(
        "INSERT INTO __diesel_schema_migrations (version) VALUES ('20200101000000')",
    )
    .await
    .unwrap();

    let err = idemstage_persistence::revert_all_migrations(db.url())
        .await
        .unwrap_err();
    assert_eq!(
        public_tables(&mut conn).await,
        tables,
        "the core's newer migrations were reverted"
    );
    assert!(err.to_string().contains("20200101000000"), "{err}");
    assert!(err.to_string().contains("nothing was reverted"), "{err}");
}

/// A database migrated before the 0.x baseline (it records the old core
/// versions, not the baseline's) is refused with a message that says so, and
/// nothing is changed: diesel alone would run the baseline on it and fail with
/// "type ulid_text already exists".
#[tokio::test]
async fn a_database_migrated_before_the_baseline_is_refused_by_name() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute(
        "DELETE FROM __diesel_schema_migrations; \
         INSERT INTO __diesel_schema_migrations (version) VALUES ('20261130000001')",
    )
    .await
    .unwrap();
    let tables = public_tables(&mut conn).await;

    let err = idemstage_persistence::migrate(db.url()).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("before the 0.x baseline"), "{text}");
    assert!(text.contains("20261130000001"), "{text}");
    assert!(text.contains("nothing was changed"), "{text}");
    assert_eq!(public_tables(&mut conn).await, tables);
}

/// The checked-in `schema.rs` must describe exactly what the migrations create:
/// same tables, columns in order, types, nullability and primary keys. Regenerate it
/// with `diesel print-schema` (diesel.toml) when this fails.
#[tokio::test]
async fn checked_in_schema_matches_migrations() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let tables = idemstage_testkit::schema::assert_schema_rs_matches(
        &mut conn,
        include_str!("../../src/schema.rs"),
    )
    .await;
    assert_eq!(
        public_tables(&mut conn).await,
        tables,
        "tables the migrations create but schema.rs lacks"
    );
}

#[tokio::test]
async fn unique_index_rejects_a_second_run_of_the_same_stage() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.batch_execute(
        "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
         VALUES ('t1', '01JDQ3W5AAAAAAAAAAAAAAAAAA', 'x', repeat('a', 64), 'k')",
    )
    .await
    .unwrap();
    let insert = |run_id: &'static str| {
        format!(
            "INSERT INTO stage_runs (id, tenant_id, item_id, stage, status, attempts,
                 max_attempts, input_hash, worker_id, started_at, lease_expires_at)
             VALUES ('{run_id}', 't1', '01JDQ3W5AAAAAAAAAAAAAAAAAA', 'intake', 'running', 1, 3,
                 'h', 'w', now(), now())"
        )
    };
    conn.batch_execute(&insert("01JDQ3W5BBBBBBBBBBBBBBBBBB"))
        .await
        .unwrap();
    let err = diesel::sql_query(insert("01JDQ3W5CCCCCCCCCCCCCCCCCC"))
        .execute(&mut conn)
        .await
        .unwrap_err();
    match err {
        DieselError::DatabaseError(DatabaseErrorKind::UniqueViolation, info) => {
            assert_eq!(
                info.constraint_name(),
                Some("stage_runs_tenant_item_stage_uq")
            );
        }
        other => panic!("expected a unique violation, got {other:?}"),
    }
    // The same stage of another item, or another stage, is fine.
    conn.batch_execute(
        "INSERT INTO stage_runs (id, tenant_id, item_id, stage, status, attempts,
             max_attempts, input_hash, worker_id, started_at, lease_expires_at)
         VALUES ('01JDQ3W5DDDDDDDDDDDDDDDDDD', 't1', '01JDQ3W5AAAAAAAAAAAAAAAAAA', 'extract',
             'running', 1, 3, 'h', 'w', now(), now())",
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn sql_constraints_refuse_bad_ids_and_statuses() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for bad in [
        // tenant with a capital letter
        "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
         VALUES ('T1', '01JDQ3W5AAAAAAAAAAAAAAAAAA', 'x', repeat('a', 64), 'k')",
        // not a ULID
        "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
         VALUES ('t1', 'not-a-ulid', 'x', repeat('a', 64), 'k')",
        // unknown job state
        "INSERT INTO jobs (id, queue, state, payload)
         VALUES ('01JDQ3W5AAAAAAAAAAAAAAAAAA', 'q', 'exploded', '{}')",
    ] {
        let err = conn.batch_execute(bad).await.unwrap_err();
        assert!(
            matches!(
                err,
                DieselError::DatabaseError(DatabaseErrorKind::CheckViolation, _)
            ),
            "{bad}: {err:?}"
        );
    }
}

/// The baseline migration writes the text CHECKs without counted repetitions (they
/// made every job UPDATE pay for a large regex automaton). Each rule must accept
/// exactly the strings the counted pattern accepts.
#[tokio::test]
async fn rewritten_text_checks_accept_exactly_what_the_original_patterns_did() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let ulid = "01JDQ3W5AAAAAAAAAAAAAAAAAA";
    let hex64 = "a".repeat(64);
    let long = |c: &str, n: usize| c.repeat(n);
    // (what is checked, the original pattern, SQL that stores `{v}`, candidates)
    let rules: [(&str, &str, &str, Vec<String>); 5] = [
        (
            "ulid_text",
            "^[0-7][0-9A-HJKMNP-TV-Z]{25}$",
            "SELECT CAST('{v}' AS ulid_text)",
            vec![
                ulid.into(),
                ulid[..25].into(),
                format!("{ulid}A"),
                format!("8{}", &ulid[1..]),
                format!("{}I", &ulid[..25]),
                format!("{}L", &ulid[..25]),
                format!("{}O", &ulid[..25]),
                format!("{}U", &ulid[..25]),
                ulid.to_lowercase(),
                format!("{ulid}\n"),
                String::new(),
            ],
        ),
        (
            "tenant_slug",
            "^[a-z0-9][a-z0-9_-]{0,62}$",
            "SELECT CAST('{v}' AS tenant_slug)",
            vec![
                "a".into(),
                "0-a_b".into(),
                long("a", 63),
                long("a", 64),
                "-a".into(),
                "_a".into(),
                "A".into(),
                "a b".into(),
                String::new(),
            ],
        ),
        (
            "stage_name",
            "^[a-z][a-z0-9_]{0,62}$",
            "SELECT CAST('{v}' AS stage_name)",
            vec![
                "a".into(),
                "a_b9".into(),
                long("a", 63),
                long("a", 64),
                "1a".into(),
                "a-b".into(),
                String::new(),
            ],
        ),
        (
            "items.input_sha256",
            "^[0-9a-f]{64}$",
            "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
             VALUES ('t1', '{id}', 'x', '{v}', 'k')",
            vec![
                hex64.clone(),
                hex64[..63].into(),
                format!("{hex64}a"),
                hex64.to_uppercase(),
                format!("{}g", &hex64[..63]),
                String::new(),
            ],
        ),
        (
            "jobs.queue",
            "^[A-Za-z0-9_.:-]{1,100}$",
            "INSERT INTO jobs (id, queue, payload) VALUES ('{id}', '{v}', '{}')",
            vec![
                "q".into(),
                "A.b:c-d_9".into(),
                long("q", 100),
                long("q", 101),
                "a b".into(),
                "a/b".into(),
                String::new(),
            ],
        ),
    ];
    for (i, (rule, pattern, store, candidates)) in rules.iter().enumerate() {
        for (k, v) in candidates.iter().enumerate() {
            #[derive(diesel::QueryableByName)]
            struct Matches {
                #[diesel(sql_type = diesel::sql_types::Bool)]
                matches: bool,
            }
            let original: Matches = diesel::sql_query("SELECT $1 ~ $2 AS matches")
                .bind::<Text, _>(v)
                .bind::<Text, _>(*pattern)
                .get_result(&mut conn)
                .await
                .unwrap();
            // A distinct valid id per row stored.
            let id = format!("01JDQ3W5AAAAAAAAAAAAAA{i:02}{k:02}");
            let sql = store.replace("{v}", v).replace("{id}", &id);
            match conn.batch_execute(&sql).await {
                Ok(()) => assert!(original.matches, "{rule} accepted {v:?}"),
                Err(DieselError::DatabaseError(DatabaseErrorKind::CheckViolation, _)) => {
                    assert!(!original.matches, "{rule} refused {v:?}")
                }
                Err(e) => panic!("{rule}, {v:?}: {e:?}"),
            }
        }
    }
}

#[tokio::test]
async fn each_test_database_is_isolated() {
    let a = TestDb::new().await;
    let b = TestDb::new().await;
    assert_ne!(a.name(), b.name());
    let mut conn_a = a.conn().await;
    conn_a
        .batch_execute(
            "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
             VALUES ('t1', '01JDQ3W5AAAAAAAAAAAAAAAAAA', 'x', repeat('a', 64), 'k')",
        )
        .await
        .unwrap();
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let count = |q: &'static str| q;
    let n_a: Count = diesel::sql_query(count("SELECT count(*) AS n FROM items"))
        .get_result(&mut conn_a)
        .await
        .unwrap();
    let n_b: Count = diesel::sql_query("SELECT count(*) AS n FROM items")
        .get_result(&mut b.conn().await)
        .await
        .unwrap();
    assert_eq!((n_a.n, n_b.n), (1, 0));
}
