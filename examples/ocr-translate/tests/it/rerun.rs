//! A rerun with new input: `idemstage::pipeline::start` with another text replaces the
//! stored input (ocr's policy is `Rerun`), ocr replaces the pages, translate goes
//! stale and runs again on the new pages.

use idemstage::{
    items::RegisterOutcome, queue::SendResult, queue::SkipReason, stage::ExecutionOutcome,
};
use ocr_translate::{pipeline, OCR, TRANSLATE};

use crate::failures::{PAGES_1, PAGES_2, TEXT_1, TEXT_2};
use crate::support::*;

#[tokio::test]
async fn a_rerun_with_new_input_replaces_the_pages_and_translate_runs_on_them() {
    let mut f = fixture().await;
    let pipeline = pipeline();
    let exec = f.executor();
    let job = f.item(&pipeline, &tenant("team-b"), TEXT_1).await;
    let [ocr, translate] = pipeline.stages() else {
        panic!("two stages")
    };
    for stage in [ocr, translate] {
        assert!(matches!(
            exec.run(&pipeline, stage, &job).await.unwrap(),
            ExecutionOutcome::Succeeded { attempt: 1, .. }
        ));
    }
    assert_eq!(f.pages(&job).await, expected_pages(&PAGES_1, 1));
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_1, 1, 1)
    );
    // ocr handed off to translate through the queue, under the stage's singleton key.
    assert_eq!(
        f.count_for(
            &job,
            "SELECT 1 FROM jobs WHERE queue = 'translate'
                AND singleton_key = 'translate:team-b:{item}'"
        )
        .await,
        1
    );

    // The same input again: nothing to do.
    let (same, registered) = f
        .start(&pipeline, &job.tenant_id, &job.item_id, TEXT_1)
        .await;
    assert!(matches!(
        registered,
        RegisterOutcome::AlreadyRegistered {
            same_input: true,
            ..
        }
    ));
    assert!(matches!(
        exec.run(&pipeline, ocr, &same).await.unwrap(),
        ExecutionOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
    ));

    // New input, as `idemstage::pipeline::start` sends it: the input is replaced.
    let started =
        idemstage::pipeline::start(&f.pool, &pipeline, &job.tenant_id, &job.item_id, TEXT_2)
            .await
            .unwrap();
    assert!(matches!(
        started.registered,
        RegisterOutcome::Replaced { .. }
    ));
    // The first ocr job was never completed (the test runs stages by hand): the
    // send is a duplicate, and that live job now carries the new input.
    assert!(matches!(started.sent, SendResult::Duplicate), "{started:?}");
    let changed = idemstage::stage::StageJob {
        input_hash: started.registered.input_sha256().to_owned(),
        ..job.clone()
    };

    // ocr re-runs on it and replaces the pages (page 3 is gone); translate's
    // success was computed from the old pages: stale.
    assert!(matches!(
        exec.run(&pipeline, ocr, &changed).await.unwrap(),
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    assert_eq!(f.pages(&job).await, expected_pages(&PAGES_2, 2));
    assert_eq!(f.status(&job, TRANSLATE).await, "stale");
    // The old translations stay until translate's rerun replaces them.
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_1, 1, 1)
    );

    // translate re-runs (its job's hash is only a wake-up) on the current pages.
    assert!(matches!(
        exec.run(&pipeline, translate, &job).await.unwrap(),
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_2, 2, 2)
    );
    // Lineage, through the core: translate's success is bound to ocr's current
    // success, and the pages it translated are that success's output.
    assert_eq!(
        f.count_for(
            &job,
            &format!(
                "SELECT 1 FROM stage_runs o
                   JOIN stage_runs r ON r.tenant_id = o.tenant_id AND r.item_id = o.item_id
                  WHERE o.item_id = '{{item}}' AND o.stage = '{OCR}' AND r.stage = '{TRANSLATE}'
                    AND o.status = 'success' AND r.status = 'success'
                    AND r.upstream_stage = '{OCR}' AND r.upstream_attempt = o.success_attempt
                    AND o.output = '{}'::jsonb AND r.output = '2'::jsonb",
                idemstage::serde_json::to_string(&PAGES_2).unwrap()
            )
        )
        .await,
        1
    );
    // Both stages are bound to the new input now.
    assert_eq!(
        f.count_for(
            &job,
            &format!(
                "SELECT 1 FROM stage_runs WHERE item_id = '{{item}}'
                    AND status = 'success' AND input_hash = '{}'",
                changed.input_hash
            )
        )
        .await,
        2
    );
}
