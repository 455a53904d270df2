//! The example pipeline through PgBouncer in transaction mode (`--pooler
//! transaction`): `idemstage enqueue` and worker processes connect through it, one
//! worker takes LISTEN from a direct `--listen-url`, the others poll; workers are
//! SIGKILLed mid-run. Checked afterwards with SQL only, on a direct connection.

use std::process::Command;

use idemstage::ids::ItemId;
use idemstage_harness::PgBouncer;

use crate::support::{assert_quiet_and_sound, count, text, wait_until, Workers};

/// `idemstage enqueue` through `url` with `--pooler transaction`; its stdout.
fn enqueue_through(url: &str, tenant: &str, item: ItemId, text: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args(["enqueue", "--pooler", "transaction", "--tenant", tenant])
        .args(["--item", &item.to_string(), "--text", text])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "error")
        .output()
        .expect("run idemstage enqueue");
    assert!(
        out.status.success(),
        "enqueue: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_pgbouncer_with_sigkilled_workers_nothing_is_lost_or_run_twice() {
    let db = idemstage_harness::example::db().await;
    // Four server sessions per (database, user) for 3 workers' pools of 11: the
    // pooler really multiplexes, and resets every session after each transaction.
    let bouncer = PgBouncer::start(db.url(), 4);
    let pooled = bouncer.url(db.url());
    let items = 30;
    for i in 0..items {
        let item = ItemId::new();
        let tenant = format!("t{}", i % 3);
        // Sent twice: the second is a duplicate, refused while the job is live.
        enqueue_through(&pooled, &tenant, item, &text(i));
        enqueue_through(&pooled, &tenant, item, &text(i));
    }
    let listen = format!("--listen-url={}", idemstage_testkit::worker_url(db.url()));
    let pooler = ["--pooler", "transaction", "--crash-rate", "0.05"];
    let mut listening = Workers::start(&pooled, 1, &[&pooler[..], &[listen.as_str()]].concat());
    let mut polling = Workers::start(&pooled, 2, &pooler);
    // `enqueue` sends its intake jobs with the default job lease (60 s): kill
    // workers only once the intakes are done, among jobs the workers sent with
    // the tests' short lease.
    let mut conn = db.conn().await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while count(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE stage = 'intake' AND status = 'success'",
    )
    .await
        < items as i64
    {
        assert!(std::time::Instant::now() < deadline, "intakes not done");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for round in 1..=3 {
        wait_until(db.url(), "work under way", 120, |c| {
            c.stages_succeeded >= items as i64 + 20 * round
        })
        .await;
        polling.kill_and_replace(round as usize % 2);
        if round == 2 {
            listening.kill_and_replace(0);
        }
    }
    let check = assert_quiet_and_sound(db.url(), 180).await;
    listening.assert_all_alive();
    polling.assert_all_alive();
    listening.stop_all();
    polling.stop_all();
    assert_eq!(check.items, items as i64, "{check:?}");
    assert_eq!(check.stages_succeeded, items as i64 * 4, "{check:?}");
}
