//! `book` reads exactly the output of the `vendor` attempt its run is bound to:
//! while it is held with one vendor, the invoice is sent again with another
//! vendor, and parse and vendor run again; the held attempt does not commit, and
//! the next one reads the new vendor.

use std::sync::Arc;

use idemstage::diesel::sql_types::{Integer, Jsonb, Nullable, Text};
use idemstage::diesel::{ExpressionMethods, QueryDsl, QueryableByName};
use idemstage::diesel_async::RunQueryDsl;
use idemstage::prelude::*;
use idemstage::{items::RegisterOutcome, stage::ExecutionOutcome};
use invoice_pipeline::schema::{invoices, vendors};
use invoice_pipeline::{Book, Parse, Vendor, VendorDirectory, Vendored};

use crate::support::*;

#[derive(QueryableByName, Debug)]
struct Run {
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Nullable<Integer>)]
    success_attempt: Option<i32>,
    #[diesel(sql_type = Nullable<Integer>)]
    upstream_attempt: Option<i32>,
    #[diesel(sql_type = Nullable<Jsonb>)]
    output: Option<idemstage::serde_json::Value>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn book_reads_the_vendor_output_it_is_bound_to() {
    let mut f = fixture().await;
    let book = Recorded::new(Book);
    let pipeline = Pipeline::builder(Parse)
        .then(Vendor::new(Arc::new(VendorDirectory::default())))
        .then(book.clone())
        .build()
        .unwrap();
    let (acme, item) = (tenant("acme"), ItemId::new());
    let (job, _) = f
        .start(&pipeline, &acme, &item, &invoice_text("Alpha GmbH", "1"))
        .await;
    for stage in ["parse", "vendor"] {
        assert!(matches!(
            f.run(&pipeline, stage, &job).await,
            ExecutionOutcome::Succeeded { attempt: 1, .. }
        ));
    }

    // book claims on vendor's first success and is held in prepare.
    let held = tokio::spawn({
        let (executor, pipeline, job) = (f.executor.clone(), pipeline.clone(), job.clone());
        async move {
            let stage = pipeline.stages()[2].clone();
            executor.run(&pipeline, &stage, &job).await.unwrap()
        }
    });
    book.started.notified().await;

    // The invoice again, from another vendor: parse (Rerun) and vendor run again.
    let (job, started) = f
        .start(&pipeline, &acme, &item, &invoice_text("Beta AG", "1"))
        .await;
    assert!(matches!(
        started.registered,
        RegisterOutcome::Replaced { .. }
    ));
    for stage in ["parse", "vendor"] {
        assert!(matches!(
            f.run(&pipeline, stage, &job).await,
            ExecutionOutcome::Succeeded { attempt: 2, .. }
        ));
    }

    // The held attempt read Alpha, which is no longer vendor's current output: it
    // commits nothing (vendor's new success made book's run stale, so its fence
    // refuses it; had it committed first, its lineage check would have).
    book.release.notify_one();
    let outcome = held.await.unwrap();
    assert!(
        matches!(
            outcome,
            ExecutionOutcome::Fenced { attempt: 1 }
                | ExecutionOutcome::UpstreamChanged { attempt: 1 }
        ),
        "{outcome:?}"
    );
    assert_eq!(f.count("SELECT 1 FROM invoices").await, 0);

    // The next attempt reads Beta: the output of vendor's success it is bound to.
    assert!(matches!(
        f.run(&pipeline, "book", &job).await,
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    let vendor_of = |name: &'static str| {
        vendors::table
            .filter(vendors::name.eq(name))
            .select(vendors::id)
    };
    let alpha: i64 = vendor_of("Alpha GmbH")
        .get_result(&mut f.conn)
        .await
        .unwrap();
    let beta: i64 = vendor_of("Beta AG").get_result(&mut f.conn).await.unwrap();
    let inputs: Vec<Vendored> = book.inputs.lock().unwrap().clone();
    let read: Vec<(i64, &str)> = inputs
        .iter()
        .map(|v| (v.vendor_id, v.invoice.vendor.as_str()))
        .collect();
    assert_eq!(read, [(alpha, "Alpha GmbH"), (beta, "Beta AG")]);
    let booked: i64 = invoices::table
        .select(invoices::vendor_id)
        .get_result(&mut f.conn)
        .await
        .unwrap();
    assert_eq!(booked, beta);

    // Through the core: book's run is bound to vendor's success (attempt 2), whose
    // kept output is what book read.
    let runs: Vec<Run> = idemstage::diesel::sql_query(
        "SELECT stage, success_attempt, upstream_attempt, output FROM stage_runs
          WHERE item_id = $1 ORDER BY stage",
    )
    .bind::<Text, _>(item.to_string())
    .load(&mut f.conn)
    .await
    .unwrap();
    let [book_run, _parse, vendor_run] = &runs[..] else {
        panic!("{runs:?}")
    };
    assert_eq!(
        (book_run.stage.as_str(), vendor_run.stage.as_str()),
        ("book", "vendor")
    );
    assert_eq!(vendor_run.success_attempt, Some(2));
    assert_eq!(book_run.upstream_attempt, Some(2));
    let kept: Vendored =
        idemstage::serde_json::from_value(vendor_run.output.clone().unwrap()).unwrap();
    assert_eq!(&kept, inputs.last().unwrap());
}
