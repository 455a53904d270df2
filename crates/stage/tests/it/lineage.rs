//! Lineage: a stage runs only on the current success of the stage before it, and
//! commits only while that success is current. Each test drives the example
//! pipeline through the executor, as workers would, and checks the database with
//! the pipeline's own checker.

use std::time::Duration;

use diesel_async::RunQueryDsl;
use idemstage_domain::{input_hash_of, InputChangePolicy, StagePolicy};
use idemstage_example::check_example_pipeline;
use idemstage_example::{self as example, Chaos};
use idemstage_stage::{ExecutionOutcome, Pipeline, StageJob};
use idemstage_testkit::count;

use crate::{fixture, Fixture};

const TEXT_1: &str = "10 Stk Schrauben M8\n2 m Kabel";
const TEXT_2: &str = "20 Stk Schrauben M8\n4 m Kabel\n1 h Montage";

/// Every stage with the same policy: `Rerun` on new input, `max_attempts` as given.
fn rerunning_pipeline(max_attempts: i32) -> Pipeline {
    example::pipeline_with(
        Chaos::default(),
        StagePolicy::default()
            .with_max_attempts(max_attempts)
            .with_on_input_change(InputChangePolicy::Rerun)
            .with_lease(Duration::from_secs(30))
            .with_heartbeat(Duration::from_secs(10)),
    )
    .unwrap()
}

/// Replaces the item's stored input (as a rerun with new input does) and returns
/// the job that carries it.
async fn replace_input(f: &mut Fixture, job: &StageJob, text: &str) -> StageJob {
    diesel::sql_query(format!(
        "UPDATE items SET input_text = '{text}', input_sha256 = '{}' WHERE id = '{}'",
        input_hash_of(text.as_bytes()),
        job.item_id
    ))
    .execute(&mut f.conn)
    .await
    .unwrap();
    StageJob {
        input_hash: input_hash_of(text.as_bytes()),
        ..job.clone()
    }
}

async fn run_all(f: &Fixture, pipeline: &Pipeline, job: &StageJob) {
    let exec = f.executor();
    for stage in pipeline.stages() {
        let outcome = exec.run(pipeline, stage, job).await.unwrap();
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { .. }),
            "{}: {outcome:?}",
            stage.name()
        );
    }
}

/// Item 5: a `calculate` job sent before `extract` ran used to claim, commit a
/// total of 0 on the missing positions, and make the real job skip for good.
#[tokio::test]
async fn a_stage_sent_before_its_upstream_ran_is_not_run() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    let job = f.item(TEXT_1).await;
    let exec = f.executor();
    let calculate = pipeline.stage("calculate").unwrap();
    let early = exec.run(&pipeline, calculate, &job).await.unwrap();
    assert!(
        !matches!(early, ExecutionOutcome::Succeeded { .. }),
        "{early:?}"
    );
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM calculation_results").await,
        0
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'calculate'"
        )
        .await,
        0,
        "a stage whose upstream is not done binds nothing"
    );
    run_all(&f, &pipeline, &job).await;
    // 10 × 1.50 + 2 × 3.20 = 21.40 EUR
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM calculation_results WHERE total_cents = 2140"
        )
        .await,
        1
    );
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert!(check.violations().is_empty(), "{check:?}");
}

/// Item 2: a rerun whose first stage ends `dead` used to leave every downstream
/// stage `stale` for ever (invalidated at the rerun's claim).
#[tokio::test]
async fn a_rerun_that_dies_invalidates_nothing() {
    let mut f = fixture().await;
    let pipeline = rerunning_pipeline(2);
    let job = f.item(TEXT_1).await;
    run_all(&f, &pipeline, &job).await;
    // Blank input: intake's rerun fails permanently (the input is refused).
    let changed = replace_input(&mut f, &job, "   ").await;
    let intake = pipeline.stage("intake").unwrap();
    let rerun = f.executor().run(&pipeline, intake, &changed).await.unwrap();
    assert!(
        matches!(rerun, ExecutionOutcome::Failed { dead: true, .. }),
        "{rerun:?}"
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_runs WHERE status = 'success'"
        )
        .await,
        3,
        "extract, feasibility and calculate keep their results"
    );
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.lost_stages, 0, "{check:?}");
    assert!(check.violations().is_empty(), "{check:?}");
}

/// Item 3: a downstream stage that used up its attempts in an earlier lineage must
/// get a fresh budget when its upstream re-runs, as a rerun of a success does.
#[tokio::test]
async fn a_rerun_gives_the_downstream_stages_a_fresh_attempt_budget() {
    let mut f = fixture().await;
    let pipeline = rerunning_pipeline(1);
    let job = f.item(TEXT_1).await;
    run_all(&f, &pipeline, &job).await;
    let changed = replace_input(&mut f, &job, TEXT_2).await;
    run_all(&f, &pipeline, &changed).await;
    // 20 × 1.50 + 4 × 3.20 + 1 × 65.00 = 107.80 EUR
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM calculation_results WHERE total_cents = 10780"
        )
        .await,
        1
    );
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert!(check.violations().is_empty(), "{check:?}");
    assert_eq!(check.runs_by_status.get("success"), Some(&4), "{check:?}");
}

/// Item 6: while extract re-runs on a new input, feasibility's old job comes back
/// (re-delivered). It used to claim at once, read the old positions and commit
/// `success`, after which the new input's job was refused: extract on the new
/// input, feasibility on the old one, for ever.
#[tokio::test]
async fn a_downstream_stage_never_commits_on_an_outdated_upstream() {
    let mut f = fixture().await;
    let pipeline = rerunning_pipeline(5);
    let job = f.item(TEXT_1).await;
    run_all(&f, &pipeline, &job).await;
    let exec = f.executor();
    let changed = replace_input(&mut f, &job, TEXT_2).await;
    let [intake, extract, feasibility, calculate] = pipeline.stages() else {
        panic!("four stages")
    };
    // Intake re-runs on the new input and succeeds: everything after it is outdated.
    assert!(matches!(
        exec.run(&pipeline, intake, &changed).await.unwrap(),
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    // The old feasibility job, re-delivered before extract re-ran: it must not run
    // on the outdated positions.
    let early = exec.run(&pipeline, feasibility, &job).await.unwrap();
    assert!(
        !matches!(early, ExecutionOutcome::Succeeded { .. }),
        "{early:?}"
    );
    for stage in [extract, feasibility, calculate] {
        // The old job's hash: a later stage's job is only a wake-up.
        let outcome = exec.run(&pipeline, stage, &job).await.unwrap();
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { .. }),
            "{}: {outcome:?}",
            stage.name()
        );
    }
    assert_eq!(
        count(
            &mut f.conn,
            &format!(
                "SELECT 1 FROM stage_runs WHERE status = 'success' AND input_hash = '{}'",
                changed.input_hash
            )
        )
        .await,
        4,
        "every stage is bound to the new input"
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM calculation_results WHERE total_cents = 10780"
        )
        .await,
        1
    );
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert!(check.violations().is_empty(), "{check:?}");
}

/// The commit checks lineage and fences in one round trip: when the input changed
/// while the body ran, the fence it sent along is rolled back, nothing of the
/// stage is written, and the run is `stale` (claimable again on the new input).
#[tokio::test]
async fn an_input_replaced_while_the_body_runs_leaves_the_run_stale_and_unwritten() {
    let mut f = fixture().await;
    // The gate's body waits for the test: the input changes between its claim
    // and its commit.
    let (gate, pipeline) = crate::gate(30_000, 30_000);
    let job = f.item(TEXT_1).await;
    let exec = f.executor();
    let running = {
        let (pipeline, job) = (pipeline.clone(), job.clone());
        tokio::spawn(async move {
            exec.run(&pipeline, pipeline.first_stage(), &job)
                .await
                .unwrap()
        })
    };
    gate.started.notified().await;
    let changed = replace_input(&mut f, &job, TEXT_2).await;
    gate.release.notify_one();
    let outcome = running.await.unwrap();
    assert_eq!(outcome, ExecutionOutcome::UpstreamChanged { attempt: 1 });
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'gate' AND status = 'stale' \
               AND success_attempt IS NULL AND last_error LIKE '%changed before it committed%'"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM audit_log WHERE action = 'gate.done'"
        )
        .await,
        0,
        "nothing of the stage is written"
    );
    // Claimable again, on the new input: it runs and commits.
    gate.release.notify_one();
    let again = f
        .executor()
        .run(&pipeline, pipeline.first_stage(), &changed)
        .await
        .unwrap();
    assert!(
        matches!(again, ExecutionOutcome::Succeeded { attempt: 2, .. }),
        "{again:?}"
    );
}
