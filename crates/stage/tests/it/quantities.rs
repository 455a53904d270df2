//! Quantities too large to price (issue 11, item 10): the example pipeline must say
//! so once and clearly, never panic, saturate or wrap around.

use diesel::sql_types::{Integer, Nullable, Text};
use idemstage_stage::StageFlow;

use super::*;

#[derive(diesel::QueryableByName, Debug, PartialEq)]
struct RunRow {
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

async fn run_of(f: &mut Fixture, job: &StageJob, stage: &str) -> RunRow {
    diesel::sql_query(
        "SELECT status::text, attempts, last_error FROM stage_runs
          WHERE item_id = $1 AND stage = $2",
    )
    .bind::<Text, _>(job.item_id.to_string())
    .bind::<Text, _>(stage)
    .get_result(&mut f.conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn an_out_of_range_quantity_makes_the_item_infeasible_with_its_reason() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    // 1e999 parses as infinity; 10 Stk is fine.
    let job = f
        .item("1e300 stk Schrauben\n1e999 Stk Muttern\n10 Stk Scheiben")
        .await;
    let exec = f.executor();
    for name in ["intake", "extract", "feasibility"] {
        let outcome = exec
            .run(&pipeline, pipeline.stage(name).unwrap(), &job)
            .await
            .unwrap();
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { attempt: 1, .. }),
            "{name}: {outcome:?}"
        );
        if name == "feasibility" {
            assert!(
                matches!(
                    outcome,
                    ExecutionOutcome::Succeeded {
                        flow: StageFlow::Stop,
                        ..
                    }
                ),
                "{outcome:?}"
            );
        }
    }
    #[derive(diesel::QueryableByName)]
    struct Reasons {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        feasible: bool,
        #[diesel(sql_type = Text)]
        reasons: String,
    }
    let r: Reasons =
        diesel::sql_query("SELECT feasible, reasons::text AS reasons FROM feasibility_results")
            .get_result(&mut f.conn)
            .await
            .unwrap();
    assert!(!r.feasible);
    assert_eq!(
        serde_json::from_str::<Vec<String>>(&r.reasons).unwrap(),
        vec![
            "position 0: quantity 1e300 is out of range (0 to 1000000000)".to_owned(),
            "position 1: quantity inf is out of range (0 to 1000000000)".to_owned(),
        ]
    );
    // Calculate was not sent, and no attempt of any stage failed or panicked.
    assert_eq!(
        count(&mut f.conn, "SELECT * FROM jobs WHERE queue = 'calculate'").await,
        0
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT * FROM stage_run_attempts WHERE outcome <> 'success'"
        )
        .await,
        0
    );
}

/// Calculate fed positions whose cents do not fit in an i64 (written by hand after
/// feasibility passed them): one permanent failure, so the run is
/// `dead` after its first attempt, with the overflow in `last_error` and no result.
#[tokio::test]
async fn calculate_fails_once_and_permanently_when_the_cents_overflow() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    let exec = f.executor();
    // One line too large to convert (1e300 × 150 cents), and two lines that fit
    // (6e16 × 150 = 9e18 cents each, below i64::MAX ≈ 9.22e18) but not their sum.
    for (quantity, expected) in [
        (
            "1e300",
            "position 0: 1e300 stk at 150 cents overflows i64 cents",
        ),
        ("6e16", "total overflows i64 cents at position 1"),
    ] {
        let job = f.item("1 stk Schrauben\n1 stk Muttern").await;
        // Lineage: calculate runs only on a feasibility success, so the rows are
        // made huge after feasibility judged them (as a buggy upstream might).
        for name in ["intake", "extract", "feasibility"] {
            exec.run(&pipeline, pipeline.stage(name).unwrap(), &job)
                .await
                .unwrap();
        }
        diesel::sql_query(format!(
            "UPDATE anfrage_extraktionen SET quantity = {quantity} WHERE item_id = $1"
        ))
        .bind::<Text, _>(job.item_id.to_string())
        .execute(&mut f.conn)
        .await
        .unwrap();
        let outcome = exec
            .run(&pipeline, pipeline.stage("calculate").unwrap(), &job)
            .await
            .unwrap();
        match &outcome {
            ExecutionOutcome::Failed {
                attempt: 1,
                error,
                dead: true,
            } => assert!(error.contains(expected), "{error}"),
            other => panic!("{quantity}: expected a dead first attempt, got {other:?}"),
        }
        let run = run_of(&mut f, &job, "calculate").await;
        assert_eq!((run.status.as_str(), run.attempts), ("dead", 1), "{run:?}");
        assert!(
            run.last_error.as_deref().unwrap_or("").contains(expected),
            "{run:?}"
        );
        // Claimed again: nothing more runs.
        let again = exec
            .run(&pipeline, pipeline.stage("calculate").unwrap(), &job)
            .await
            .unwrap();
        assert!(
            !matches!(again, ExecutionOutcome::Failed { .. }),
            "{again:?}"
        );
        assert_eq!(run_of(&mut f, &job, "calculate").await.attempts, 1);
    }
    assert_eq!(
        count(&mut f.conn, "SELECT * FROM calculation_results").await,
        0
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT * FROM stage_run_attempts WHERE error LIKE '%panicked%'"
        )
        .await,
        0
    );
}
