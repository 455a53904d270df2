//! The team's binary, `ocr-translate`: the idemstage command line for this
//! pipeline through `idemstage_cli::run_app`, run as processes.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idemstage_testkit::{count, TestDb};

fn ocr_translate(db: &TestDb, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ocr-translate"))
        .args(args)
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "error")
        .output()
        .expect("run ocr-translate")
}

const ITEM: &str = "01JDQ3W5AAAAAAAAAAAAAAAAAA";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_migrates_enqueues_works_and_reports_this_pipeline() {
    // The core's migrations only: `migrate` adds this crate's on top.
    let db = TestDb::new().await;
    let migrated = ocr_translate(&db, &["migrate"]);
    assert!(migrated.status.success(), "{migrated:?}");
    assert_eq!(
        String::from_utf8_lossy(&migrated.stdout).trim(),
        "applied 2 migration(s)"
    );
    let enqueued = ocr_translate(
        &db,
        &[
            "enqueue",
            "--tenant",
            "t1",
            "--item",
            ITEM,
            "--text",
            "erste seite\n\nzweite seite",
        ],
    );
    assert!(enqueued.status.success(), "{enqueued:?}");
    // The example's fault flags and its demo are not this pipeline's.
    let refused = ocr_translate(&db, &["worker", "--crash-rate", "0.5"]);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert_eq!(ocr_translate(&db, &["demo"]).status.code(), Some(2));

    let mut worker = Command::new(env!("CARGO_BIN_EXE_ocr-translate"))
        .args(["worker", "--concurrency", "2"])
        // As a deployed worker connects: a login role in idemstage_worker.
        .env("DATABASE_URL", db.worker_url())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the worker");
    let mut conn = db.conn().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE stage = 'translate' AND status = 'success'",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker did not finish the pipeline"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(count(&mut conn, "SELECT 1 FROM translations").await, 2);
    let term = Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = worker.wait().unwrap();
    assert!(status.success(), "worker exit {status:?}");

    let report = ocr_translate(&db, &["status", "--json"]);
    assert!(report.status.success(), "{report:?}");
    let json = String::from_utf8_lossy(&report.stdout);
    assert!(json.contains("translate"), "{json}");
    assert!(json.contains("success"), "{json}");
}

/// A team's binary names itself (`App::with_name`), not idemstage: `--version`
/// and the usage lines say `ocr-translate`.
#[test]
fn the_binary_says_its_own_name_and_version() {
    let out = Command::new(env!("CARGO_BIN_EXE_ocr-translate"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.trim(),
        format!("ocr-translate {}", env!("CARGO_PKG_VERSION"))
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ocr-translate"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("Usage: ocr-translate"), "{help}");
}
