//! The `greet` stage against a real PostgreSQL (`DATABASE_URL`): a database of its
//! own with the core's and this crate's migrations, the stage run by an
//! executor, its row checked, and a second run of the same job that writes nothing.

// The binary's one file, as a module: its stage, pipeline and migrations.
#[path = "../src/main.rs"]
#[allow(dead_code)] // its `main`
mod minimal;

use std::sync::Arc;

use idemstage::diesel::{ExpressionMethods, QueryDsl};
use idemstage::diesel_async::RunQueryDsl;
use idemstage::{
    ids::ItemId, ids::TenantId, ids::WorkerId, pipeline::start, queue::SkipReason,
    runs::PgRunRepository, stage::ExecutionOutcome, stage::Executor, stage::StageJob,
};
use idemstage_testkit::TestDb;
use minimal::greetings;

#[tokio::test]
async fn greet_writes_its_row_once() {
    let db = TestDb::with_migrations(vec![minimal::MIGRATIONS]).await;
    let pool = db.pool(4).await;
    let pipeline = minimal::pipeline();
    let (tenant, item) = (TenantId::parse("acme").unwrap(), ItemId::new());

    // Register the input and send the first job, as `enqueue` does.
    let started = start(&pool, &pipeline, &tenant, &item, "world")
        .await
        .unwrap();
    let job = StageJob {
        tenant_id: tenant.clone(),
        item_id: item,
        input_hash: started.registered.input_sha256().to_owned(),
    };

    // Run the stage as a worker would, without the queue.
    let executor = Executor::new(
        Arc::new(PgRunRepository::new(pool.clone())),
        WorkerId::generate(),
    );
    let stage = pipeline.first_stage();
    let first = executor.run(&pipeline, stage, &job).await.unwrap();
    assert!(
        matches!(first, ExecutionOutcome::Succeeded { attempt: 1, .. }),
        "{first:?}"
    );

    // The same job again (a duplicate send, a redelivery): the claim skips it.
    let second = executor.run(&pipeline, stage, &job).await.unwrap();
    assert!(
        matches!(
            second,
            ExecutionOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
        ),
        "{second:?}"
    );

    // Exactly one row, the greeting of the first run (read as the test's
    // superuser, which row-level security does not restrict).
    let mut conn = db.conn().await;
    let rows: Vec<(String, String)> = greetings::table
        .filter(greetings::item_id.eq(item.to_string()))
        .select((greetings::tenant_id, greetings::greeting))
        .load(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, [("acme".to_owned(), "Hello, world!".to_owned())]);
}
