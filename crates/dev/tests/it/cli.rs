//! The `idemstage` CLI with bad input: a clear message, a non-zero exit code, and
//! nothing written.

use std::process::{Command, Output};

use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;
use idemstage_testkit::TestDb;

fn idemstage(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "error")
        .output()
        .expect("run idemstage")
}

async fn rows(db: &TestDb) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    diesel::sql_query("SELECT (SELECT count(*) FROM items) + (SELECT count(*) FROM jobs) AS n")
        .get_result::<N>(&mut db.conn().await)
        .await
        .unwrap()
        .n
}

const ITEM: &str = "01JDQ3W5AAAAAAAAAAAAAAAAAA";

/// `idemstage enqueue` of item `ITEM` with a one-line input for `tenant`.
fn enqueue(db: &TestDb, tenant: &str) -> Output {
    idemstage(
        db,
        &[
            "enqueue", "--tenant", tenant, "--item", ITEM, "--text", "1 Stk",
        ],
    )
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_a_nonzero_exit_and_writes_nothing() {
    let db = idemstage_harness::example::db().await;
    let dir = std::env::temp_dir().join(format!("idemstage-dev-{}", ulid_like()));
    std::fs::create_dir_all(&dir).unwrap();
    let big = dir.join("big.txt");
    std::fs::write(&big, "a".repeat(10 * 1024 * 1024)).unwrap();
    let binary = dir.join("binary.bin");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x01]).unwrap();
    // Valid UTF-8, but PostgreSQL text cannot hold a NUL (it was the raw 22021
    // error, exit 1). `--text` cannot carry one: an argument is a C string.
    let nul = dir.join("nul.txt");
    std::fs::write(&nul, "1 Stk\0Schrauben\n").unwrap();
    let missing = dir.join("missing.txt");
    let (big, binary, nul, missing) = (
        big.to_str().unwrap().to_owned(),
        binary.to_str().unwrap().to_owned(),
        nul.to_str().unwrap().to_owned(),
        missing.to_str().unwrap().to_owned(),
    );
    let lowercase = ITEM.to_lowercase();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--tenant", "Acme GmbH", "--item", ITEM, "--text", "1 Stk"],
            "invalid tenant id",
        ),
        (
            vec![
                "--tenant",
                "t1'; DROP TABLE items;--",
                "--item",
                ITEM,
                "--text",
                "1 Stk",
            ],
            "invalid tenant id",
        ),
        (
            vec!["--tenant", "t1", "--item", "12345", "--text", "1 Stk"],
            "invalid item id",
        ),
        (
            vec!["--tenant", "t1", "--item", &lowercase, "--text", "1 Stk"],
            "invalid item id",
        ),
        (
            vec!["--tenant", "t1", "--item", ITEM, "--file", &missing],
            "cannot read",
        ),
        (
            vec!["--tenant", "t1", "--item", ITEM, "--text", "  \n "],
            "input is empty",
        ),
        (
            vec!["--tenant", "t1", "--item", ITEM, "--file", &big],
            "larger than the limit",
        ),
        (
            vec!["--tenant", "t1", "--item", ITEM, "--file", &binary],
            "not UTF-8",
        ),
        (
            vec!["--tenant", "t1", "--item", ITEM, "--file", &nul],
            "NUL byte",
        ),
    ];
    for (args, message) in cases {
        let mut full = vec!["enqueue"];
        full.extend(args.iter().copied());
        let out = idemstage(&db, &full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.lines().count() <= 2,
            "one clear line, not a dump: {stderr}"
        );
    }
    assert_eq!(rows(&db).await, 0, "bad input wrote something");

    // An item id of another tenant: refused, and the first tenant's data stays.
    let ok = enqueue(&db, "t1");
    assert!(ok.status.success());
    assert_eq!(rows(&db).await, 2);
    let other = enqueue(&db, "t2");
    assert_eq!(other.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&other.stderr).contains("belongs to another tenant"));
    assert_eq!(rows(&db).await, 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn enqueue_prints_the_job_id_then_duplicate() {
    let db = idemstage_harness::example::db().await;
    let first = enqueue(&db, "t1");
    let id = String::from_utf8(first.stdout).unwrap();
    assert_eq!(id.trim().len(), 26, "{id}");
    let second = enqueue(&db, "t1");
    assert_eq!(
        String::from_utf8(second.stdout).unwrap().trim(),
        "duplicate"
    );
}

#[tokio::test]
async fn bench_refuses_bad_counts_before_it_touches_the_database() {
    let db = idemstage_harness::example::db().await;
    let ok = enqueue(&db, "t1");
    assert!(ok.status.success());
    for (args, message) in [
        (vec!["--drain-loops", "0"], "--drain-loops"),
        (vec!["--drain-loops", "2,0"], "--drain-loops"),
        (vec!["--jobs", "0"], "counts must be positive"),
        (vec!["--duration-s", "0"], "--duration-s"),
    ] {
        let mut full = vec!["bench", "queue"];
        full.extend(args.iter().copied());
        let out = idemstage(&db, &full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    for args in [
        vec!["--items-per-s", "0"],
        vec!["--items-per-s", "NaN"],
        vec!["--stress-s", "0"],
        vec!["--warmup-s=-1"],
        vec!["--pressure-workers", "0"],
        vec!["--peak-items", "0"],
        vec!["--workload", "queue", "--pressure-retention-s", "0"],
        // The retention is the no-op queue's workers' (the pipeline's keep theirs).
        vec!["--pressure-retention-s", "60"],
    ] {
        let mut full = vec!["bench", "pressure"];
        full.extend(args.iter().copied());
        let out = idemstage(&db, &full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("pressure:"), "{args:?}: {stderr}");
    }
    // Not a benchmark database either: nothing was emptied.
    assert_eq!(rows(&db).await, 2);
}

/// The pressure bench's producer registers an item and its first job in one
/// transaction, as a team's `start_in` does. It committed the items first: a
/// job send that failed left items without a job, and in the two-hour soak a
/// reconciler's pass between the two commits sent three items a job of its own
/// (harmless, but three jobs more than items x stages: a violation). Here every
/// job send fails: the run ends with the error, its workers killed (any error
/// of a run does), and no item is left behind.
#[tokio::test]
async fn bench_pressure_registers_an_item_with_its_job_or_not_at_all() {
    use diesel_async::SimpleAsyncConnection;
    let db = idemstage_harness::example::db().await;
    assert!(db.url().contains("bench"), "{}", db.url());
    db.conn()
        .await
        .batch_execute(
            "CREATE FUNCTION refuse_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'no jobs today'; END $$;
             CREATE TRIGGER refuse_jobs BEFORE INSERT ON jobs
                 FOR EACH ROW EXECUTE FUNCTION refuse_jobs();",
        )
        .await
        .unwrap();
    let out = idemstage(
        &db,
        &[
            "bench",
            "pressure",
            "--workload",
            "pipeline",
            "--items-per-s",
            "20",
            "--warmup-s",
            "0",
            "--clean-s",
            "1",
            "--stress-s",
            "1",
            "--recovery-s",
            "1",
            "--sample-every-s",
            "1",
            "--pressure-workers",
            "1",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no jobs today"), "{stderr}");
    assert_eq!(rows(&db).await, 0, "an item was registered without its job");
    // Its worker processes went with it: their sessions end (a killed
    // process's session ends when the server sees its socket close).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut conn = db.conn().await;
    loop {
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let others = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity
              WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .get_result::<N>(&mut conn)
        .await
        .unwrap()
        .n;
        if others == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{others} sessions of the run's workers outlived it"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The demo's verdict covers every row, so on a database with other items (and
/// no "demo" in its name, which it would empty) it refuses to start.
#[tokio::test]
async fn demo_refuses_a_database_that_holds_other_items() {
    let db = idemstage_harness::example::db().await;
    let ok = enqueue(&db, "t1");
    assert!(ok.status.success());
    let out = idemstage(&db, &["demo", "--items", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("already holds 1 items"), "{stderr}");
    assert_eq!(rows(&db).await, 2, "the demo touched the database");
}

/// The demo's flags for the local "LLM" service: out of range is exit 2 and
/// nothing written.
#[tokio::test]
async fn demo_refuses_bad_llm_flags_before_it_touches_the_database() {
    let db = idemstage_harness::example::db().await;
    let ok = enqueue(&db, "t1");
    assert!(ok.status.success());
    for (args, message) in [
        (vec!["--llm-failure-rate", "1"], "--llm-failure-rate"),
        (vec!["--llm-failure-rate=-0.1"], "--llm-failure-rate"),
        (vec!["--llm-429-every", "0"], "--llm-429-every"),
    ] {
        let mut full = vec!["demo", "--items", "1"];
        full.extend(args.iter().copied());
        let out = idemstage(&db, &full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    assert_eq!(rows(&db).await, 2, "the demo touched the database");
}

/// With the "LLM" refusing (429) and failing (500) some requests, and stages
/// crashing after the call, every extraction still pays exactly one call: the
/// demo's verdict says so (it counts a difference as a violation), and the
/// service saw more requests than it answered.
#[tokio::test]
async fn the_demo_pays_one_llm_call_per_extraction_under_refusals_and_failures() {
    let db = idemstage_harness::example::db().await;
    let out = idemstage(
        &db,
        &[
            "demo",
            "--items",
            "40",
            "--workers",
            "2",
            "--crash-rate",
            "0.1",
            "--llm-429-every",
            "7",
            "--llm-failure-rate",
            "0.2",
            "--seed",
            "3",
            "--json",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(report["llm_calls"], report["extractions"], "{report}");
    assert!(
        report["llm_requests"].as_u64().unwrap() > report["llm_calls"].as_u64().unwrap(),
        "no request was refused or failed: {report}"
    );
}

#[tokio::test]
async fn pooler_flags_are_checked_before_anything_runs() {
    let db = idemstage_harness::example::db().await;
    for (args, code, message) in [
        (
            vec!["migrate", "--pooler", "transaction"],
            2,
            "needs a direct connection",
        ),
        (
            vec!["demo", "--pooler", "transaction"],
            2,
            "needs a direct connection",
        ),
        (
            vec!["worker", "--pooler", "sometimes"],
            2,
            "invalid value 'sometimes'",
        ),
        (
            vec!["worker", "--poll-ms", "0"],
            2,
            "--poll-ms must be positive",
        ),
        (
            vec![
                "worker",
                "--allow-owner",
                "--listen-url",
                "postgres://nobody@127.0.0.1:1/none",
            ],
            3,
            "--listen-url",
        ),
    ] {
        let out = idemstage(&db, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    assert_eq!(rows(&db).await, 0);
}

#[test]
fn an_unreachable_database_is_exit_code_3() {
    let out = Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["status"])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("database unavailable"));
}

fn ulid_like() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// Item 8: `enqueue` of a registered item with *other* text used to exit 0 and
/// send a job carrying the new hash while the stored text stayed the old one. The
/// example's first stage rejects input changes: exit 2, and nothing changes.
#[tokio::test]
async fn enqueue_with_other_text_for_a_registered_item_is_refused() {
    let db = idemstage_harness::example::db().await;
    let first = enqueue(&db, "t1");
    assert!(first.status.success(), "{first:?}");
    let before = rows(&db).await;
    let again = enqueue(&db, "t1");
    assert!(
        again.status.success(),
        "the same text again is normal: {again:?}"
    );
    let changed = idemstage(
        &db,
        &[
            "enqueue", "--tenant", "t1", "--item", ITEM, "--text", "2 Stk",
        ],
    );
    assert_eq!(changed.status.code(), Some(2), "{changed:?}");
    let stderr = String::from_utf8_lossy(&changed.stderr);
    assert!(stderr.contains("registered with another input"), "{stderr}");
    assert_eq!(rows(&db).await, before, "nothing was written");
    #[derive(diesel::QueryableByName)]
    struct Text {
        #[diesel(sql_type = diesel::sql_types::Text)]
        input_text: String,
    }
    let stored: Text = diesel::sql_query("SELECT input_text FROM items")
        .get_result(&mut db.conn().await)
        .await
        .unwrap();
    assert_eq!(stored.input_text, "1 Stk");
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `pause`, `resume` and `limit` write the controls the fetch enforces, with
/// typed outcomes in `--json`; bad values exit 2 and write nothing.
#[tokio::test]
async fn pause_resume_and_limit_set_the_stage_controls() {
    let db = TestDb::new().await;
    // A tenant is known (may be paused) once it has an item.
    let acme = idemstage(
        &db,
        &[
            "enqueue", "--tenant", "acme", "--item", ITEM, "--text", "1 Stk",
        ],
    );
    assert!(acme.status.success(), "{acme:?}");
    let pause = [
        "pause", "--stage", "extract", "--tenant", "acme", "--actor", "alice", "--json",
    ];
    let paused = json_of(&idemstage(&db, &pause));
    assert_eq!(paused["outcome"], "paused");
    assert_eq!(paused["actor"], "alice");
    assert_eq!(
        json_of(&idemstage(&db, &pause))["outcome"],
        "already_paused"
    );
    let resume = ["resume", "--stage", "extract", "--tenant", "acme", "--json"];
    assert_eq!(json_of(&idemstage(&db, &resume))["outcome"], "resumed");
    assert_eq!(json_of(&idemstage(&db, &resume))["outcome"], "not_paused");

    let shown = json_of(&idemstage(
        &db,
        &[
            "limit",
            "--stage",
            "extract",
            "--every-tenant",
            "--max-active",
            "2",
            "--rate",
            "60/min",
            "--json",
        ],
    ));
    let every = shown["controls"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["scope"] == "*")
        .unwrap()
        .clone();
    assert_eq!(every["max_active"], 2);
    assert_eq!(every["rate"]["count"], 60);
    assert_eq!(every["rate"]["per_ms"], 60_000);

    for bad in [
        &["limit", "--stage", "extract", "--rate", "5/week"][..],
        &["limit", "--stage", "extract", "--weight", "3"][..],
        &["pause", "--stage", "Bad Stage"][..],
        &["pause", "--stage", "extract", "--tenant", "Not A Slug"][..],
        &["pause", "--stage", "extract", "--actor", " "][..],
        &["limit", "--stage", "extract", "--priority-aging", "0s"][..],
        &["limit", "--stage", "extract", "--priority-aging", "30"][..],
        &["limit", "--stage", "extract", "--priority-aging", "8d"][..],
        &["limit", "--stage", "extract", "--priority-aging", "200h"][..],
        &[
            "limit",
            "--stage",
            "extract",
            "--priority-aging",
            "30s",
            "--tenant",
            "acme",
        ][..],
    ] {
        let out = idemstage(&db, bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {out:?}");
        assert!(!out.stderr.is_empty(), "{bad:?}: no message");
    }
    let controls = json_of(&idemstage(
        &db,
        &["limit", "--stage", "extract", "--show", "--json"],
    ));
    assert_eq!(
        controls["controls"].as_array().unwrap().len(),
        2,
        "{controls}"
    );
    // Three changes, newest first; the repeated pause and resume and the refused
    // commands changed nothing.
    let changes: Vec<(String, String, String)> = controls["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["change"].as_str().unwrap().to_owned(),
                c["scope"].as_str().unwrap().to_owned(),
                c["actor"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect();
    let kinds: Vec<(&str, &str)> = changes
        .iter()
        .map(|(k, s, _)| (k.as_str(), s.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [("limits", "*"), ("resume", "acme"), ("pause", "acme")],
        "{controls}"
    );
    assert_eq!(changes[2].2, "alice");
    // Without --actor: $USER, else the database user; never empty.
    assert!(
        !changes[0].2.is_empty() && !changes[1].2.is_empty(),
        "{controls}"
    );
    // Priority aging: the stage's own row, kept apart from the limits.
    let aged = json_of(&idemstage(
        &db,
        &[
            "limit",
            "--stage",
            "extract",
            "--priority-aging",
            "30s",
            "--json",
        ],
    ));
    let stage_row = |v: &serde_json::Value| {
        v["controls"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["scope"] == "")
            .cloned()
            .unwrap()
    };
    assert_eq!(stage_row(&aged)["priority_aging_ms"], 30_000, "{aged}");
    assert_eq!(aged["changes"][0]["priority_aging_ms"], 30_000, "{aged}");
    let off = json_of(&idemstage(
        &db,
        &[
            "limit",
            "--stage",
            "extract",
            "--priority-aging",
            "off",
            "--json",
        ],
    ));
    assert_eq!(
        stage_row(&off)["priority_aging_ms"],
        serde_json::Value::Null,
        "{off}"
    );
}

/// `enqueue` of an item whose first stage already succeeded on the same input
/// printed a fresh job id (of a job that only found the stage done). It says
/// `finished` now, and sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_of_a_finished_item_says_it_is_finished_not_a_job_id() {
    use std::sync::Arc;
    let db = idemstage_harness::example::db().await;
    let first = enqueue(&db, "t1");
    assert!(first.status.success());
    let id = String::from_utf8(first.stdout).unwrap();
    assert_eq!(id.trim().len(), 26, "{id}");
    let worker = crate::support::start_pipeline_worker(
        db.pool(8).await,
        db.url(),
        crate::support::pipeline(),
        2,
        Arc::new(idemstage::worker::Counters::default()),
    );
    crate::support::assert_quiet_and_sound(db.url(), 60).await;
    crate::support::stop_pipeline_worker(worker).await;
    let jobs_before = idemstage_testkit::count(&mut db.conn().await, "SELECT 1 FROM jobs").await;

    let second = enqueue(&db, "t1");
    assert!(second.status.success(), "{second:?}");
    assert_eq!(String::from_utf8(second.stdout).unwrap().trim(), "finished");
    let stderr = String::from_utf8(second.stderr).unwrap();
    assert!(stderr.contains("already succeeded"), "{stderr}");
    // And nothing was sent.
    assert_eq!(
        idemstage_testkit::count(&mut db.conn().await, "SELECT 1 FROM jobs").await,
        jobs_before
    );
}
