//! `idemstage worker` as real OS processes against one database: duplicated sends,
//! a SIGKILL mid-run, a SIGTERM for a clean stop. Checked afterwards with SQL only.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use diesel_async::AsyncConnection;
use idemstage_domain::{AnfrageId, TenantId};
use idemstage_persistence::anfragen::register_anfrage;
use idemstage_persistence::report::check_example_pipeline;
use idemstage_persistence::TxError;
use idemstage_stage::example::{self, Chaos};
use idemstage_stage::first_job;
use idemstage_testkit::TestDb;

/// Kills its worker processes when dropped, so a failing test leaves none behind.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn worker(db: &TestDb, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args([
            "worker",
            "--concurrency",
            "4",
            "--stage-lease-ms",
            "1500",
            "--job-lease-ms",
            "3000",
        ])
        .args(extra)
        .env("DATABASE_URL", db.url())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start idemstage worker")
}

/// Sends `n` anfragen, each twice, the way `idemstage enqueue` does, with a job
/// lease as short as the workers' (so a killed worker's jobs come back soon).
async fn enqueue(db: &TestDb, n: usize) {
    let mut options = idemstage_stage::Pipeline::default_send_options();
    options.expire_in = Duration::from_millis(3000);
    let pipeline = example::pipeline(Chaos::default()).with_send_options(options);
    let mut conn = db.conn().await;
    for i in 0..n {
        let tenant = TenantId::parse(&format!("t{}", i % 3)).unwrap();
        let anfrage = AnfrageId::new();
        let text = format!("{} Stk Schrauben\n{} m Kabel", i + 1, i % 7 + 1);
        for _ in 0..2 {
            let job = first_job(
                &pipeline,
                tenant.clone(),
                anfrage,
                idemstage_domain::input_hash_of(text.as_bytes()),
            );
            conn.transaction::<_, TxError, _>(async |conn| {
                register_anfrage(conn, &tenant, &anfrage, &text).await?;
                Ok(idemstage_persistence::queue::send_in(conn, &job).await?)
            })
            .await
            .unwrap();
        }
    }
}

async fn wait_until(
    db: &TestDb,
    what: &str,
    secs: u64,
    mut done: impl FnMut(&idemstage_persistence::report::PipelineCheck) -> bool,
) -> idemstage_persistence::report::PipelineCheck {
    let mut conn = db.conn().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let check = check_example_pipeline(&mut conn).await.unwrap();
        if done(&check) {
            return check;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {check:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn wait_exit(child: &mut Child, secs: u64) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(std::time::Instant::now() < deadline, "worker did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_worker_processes_one_killed_lose_nothing_and_run_nothing_twice() {
    let db = TestDb::new().await;
    enqueue(&db, 60).await;
    let mut workers: Vec<Child> = (0..3)
        .map(|_| worker(&db, &["--crash-rate", "0.05"]))
        .collect();
    // Kill one worker with SIGKILL once work is under way (it holds claims and jobs).
    wait_until(&db, "first successes", 60, |c| c.stages_succeeded >= 20).await;
    workers[0].kill().unwrap();
    workers[0].wait().unwrap();
    let check = wait_until(&db, "every anfrage final", 120, |c| {
        c.anfragen_final == c.anfragen
    })
    .await;
    for w in &mut workers[1..] {
        signal(w, "-TERM");
        assert!(wait_exit(w, 30).success());
    }
    let mut conn = db.conn().await;
    let check = {
        let _ = check;
        check_example_pipeline(&mut conn).await.unwrap()
    };
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.anfragen, 60);
    assert_eq!(check.stages_succeeded, 60 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stops_cleanly_on_sigterm() {
    let db = TestDb::new().await;
    enqueue(&db, 10).await;
    let mut w = Workers(vec![worker(&db, &[])]);
    wait_until(&db, "work under way", 60, |c| c.stages_succeeded >= 1).await;
    signal(&w.0[0], "-TERM");
    let status = wait_exit(&mut w.0[0], 30);
    assert!(status.success(), "{status:?}");
    // Whatever it had in flight was finished or released, never left claimed.
    let mut conn = db.conn().await;
    let running: i64 = {
        use diesel::sql_types::BigInt;
        use diesel_async::RunQueryDsl;
        #[derive(diesel::QueryableByName)]
        struct N {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        diesel::sql_query("SELECT count(*) AS n FROM pipeline_runs WHERE status = 'running' AND lease_expires_at > now()")
            .get_result::<N>(&mut conn)
            .await
            .unwrap()
            .n
    };
    assert_eq!(running, 0);
}
