//! Issue 29, item 5: the largest inputs the example accepts run to the end through
//! real `idemstage` processes (`enqueue --file`, `worker`), in bounded time.

use std::process::Command;
use std::time::Instant;

use idemstage::ids::ItemId;

use crate::support::{self, count, Workers};

/// 72,000 lines under the 1 MiB limit, enqueued from a file and worked by one
/// worker process: extract's one INSERT of 72,000 rows x 9 columns broke the
/// protocol's 65,535 bind parameters, was classed "database unavailable" and
/// released uncounted, every few seconds, for ever. Now every stage succeeds
/// within a minute (the time is printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_72000_line_input_from_a_file_runs_through_a_worker_process_within_a_minute() {
    let db = idemstage_harness::example::db().await;
    let dir = std::env::temp_dir().join(format!("idemstage-large-{}", ItemId::new()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("input.txt");
    let text: String = (0..72_000)
        .map(|i| format!("{} stk S\n", i % 90 + 1))
        .collect();
    assert!(text.len() < 1 << 20, "{} bytes", text.len());
    std::fs::write(&file, &text).unwrap();
    let item = ItemId::new().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["enqueue", "--tenant", "t1", "--item", &item, "--file"])
        .arg(&file)
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "error")
        .output()
        .expect("run idemstage enqueue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let started = Instant::now();
    let mut workers = Workers::start(db.url(), 1, &[]);
    let check =
        support::wait_until(db.url(), "the 72,000-line item done", 60, |c| c.is_quiet()).await;
    let took = started.elapsed();
    eprintln!("72,000 lines through a worker process: {took:?} ({check:?})");
    workers.assert_all_alive();
    workers.stop_all();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.stages_succeeded, 4, "{check:?}");
    let mut conn = db.conn().await;
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM anfrage_extraktionen").await,
        72_000
    );
    // Nothing was interrupted or failed on the way.
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_run_attempts WHERE outcome <> 'success'"
        )
        .await,
        0
    );
}
