//! The pipeline's paths: invoices of two tenants, a duplicate send, and a vendor
//! commit that fails once after its paid call.

use std::sync::Arc;

use idemstage::diesel::{ExpressionMethods, QueryDsl};
use idemstage::diesel_async::RunQueryDsl;
use idemstage::prelude::*;
use idemstage::{queue::SendResult, queue::SkipReason, stage::ExecutionOutcome};
use invoice_pipeline::schema::{invoice_lines, invoices, vendors};
use invoice_pipeline::{Book, Parse, Vendor, VendorDirectory};

use crate::support::*;

#[tokio::test]
async fn invoices_of_two_tenants_book_with_their_own_vendors() {
    let mut f = fixture().await;
    let directory = Arc::new(VendorDirectory::default());
    let pipeline = invoice_pipeline::pipeline_with(directory.clone());
    let (a, b) = (tenant("tenant-a"), tenant("tenant-b"));
    // Two invoices of ACME for tenant A (the second spells it otherwise), one
    // for tenant B.
    let mut booked = Vec::new();
    for (tenant, vendor, number) in [
        (&a, "ACME GmbH", "A-1"),
        (&a, "acme  gmbh", "A-2"),
        (&b, "ACME GmbH", "B-1"),
    ] {
        let item = ItemId::new();
        let (job, _) = f
            .start(&pipeline, tenant, &item, &invoice_text(vendor, number))
            .await;
        f.run_all(&pipeline, &job).await;
        booked.push((tenant.clone(), item, number));
    }
    assert_eq!(directory.calls(), 3);

    // One vendor per tenant: A's second invoice reused A's vendor (insert-or-get),
    // B got its own row.
    let rows: Vec<(String, i64, String)> = vendors::table
        .order(vendors::id)
        .select((vendors::tenant_id, vendors::id, vendors::name_key))
        .load(&mut f.conn)
        .await
        .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(
        (rows[0].0.as_str(), rows[0].2.as_str()),
        ("tenant-a", "acme gmbh")
    );
    assert_eq!(
        (rows[1].0.as_str(), rows[1].2.as_str()),
        ("tenant-b", "acme gmbh")
    );
    assert_eq!(
        f.count("SELECT 1 FROM audit_log WHERE action = 'vendor.created'")
            .await,
        2
    );
    assert_eq!(
        f.count("SELECT 1 FROM audit_log WHERE action = 'vendor.reused'")
            .await,
        1
    );

    // Each invoice booked for its tenant's vendor, with its two lines.
    for (tenant, item, number) in booked {
        let (vendor_id, stored_number, total): (i64, String, i64) = invoices::table
            .filter(invoices::tenant_id.eq(tenant.as_str()))
            .filter(invoices::item_id.eq(item.to_string()))
            .select((invoices::vendor_id, invoices::number, invoices::total_cents))
            .get_result(&mut f.conn)
            .await
            .unwrap();
        let vendor_of_tenant = rows.iter().find(|r| r.0 == tenant.as_str()).unwrap().1;
        assert_eq!(
            (vendor_id, stored_number.as_str(), total),
            (vendor_of_tenant, number, 4250)
        );
        let lines: Vec<(i32, String)> = invoice_lines::table
            .filter(invoice_lines::item_id.eq(item.to_string()))
            .order(invoice_lines::position)
            .select((invoice_lines::position, invoice_lines::description))
            .load(&mut f.conn)
            .await
            .unwrap();
        assert_eq!(lines, [(1, "Schrauben".into()), (2, "Muttern".into())]);
    }
}

#[tokio::test]
async fn a_duplicate_send_books_once() {
    let mut f = fixture().await;
    let directory = Arc::new(VendorDirectory::default());
    let pipeline = invoice_pipeline::pipeline_with(directory.clone());
    let (acme, item) = (tenant("acme"), ItemId::new());
    let text = invoice_text("Beta AG", "7");

    // Sent twice: the second send finds the first job live.
    let (job, first) = f.start(&pipeline, &acme, &item, &text).await;
    assert!(matches!(first.sent, SendResult::Sent(_)), "{first:?}");
    let (again, second) = f.start(&pipeline, &acme, &item, &text).await;
    assert_eq!(again, job);
    assert!(matches!(second.sent, SendResult::Duplicate), "{second:?}");
    f.run_all(&pipeline, &job).await;

    // Every stage delivered again (a redelivered job, a second worker): skipped.
    for stage in pipeline.stages() {
        let outcome = f.executor.run(&pipeline, stage, &job).await.unwrap();
        assert!(
            matches!(
                outcome,
                ExecutionOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
            ),
            "{}: {outcome:?}",
            stage.name()
        );
    }
    // And sent once more after it finished: nothing runs.
    let (_, third) = f.start(&pipeline, &acme, &item, &text).await;
    assert!(!matches!(third.sent, SendResult::Sent(_)), "{third:?}");

    assert_eq!(directory.calls(), 1);
    assert_eq!(f.count("SELECT 1 FROM vendors").await, 1);
    assert_eq!(f.count("SELECT 1 FROM invoices").await, 1);
    assert_eq!(f.count("SELECT 1 FROM invoice_lines").await, 2);
    assert_eq!(
        f.count("SELECT 1 FROM stage_run_attempts WHERE outcome = 'success'")
            .await,
        3
    );
}

#[tokio::test]
async fn a_vendor_commit_that_fails_once_does_not_pay_the_lookup_twice() {
    let mut f = fixture().await;
    let directory = Arc::new(VendorDirectory::default());
    let pipeline = Pipeline::builder(Parse)
        .then(FailsCommitOnce::new(Vendor::new(directory.clone())))
        .then(Book)
        .build()
        .unwrap();
    let (job, _) = f
        .start(
            &pipeline,
            &tenant("acme"),
            &ItemId::new(),
            &invoice_text("Gamma KG", "9"),
        )
        .await;
    assert!(matches!(
        f.run(&pipeline, "parse", &job).await,
        ExecutionOutcome::Succeeded { .. }
    ));

    // The first attempt: the lookup is paid, the vendor row written, then the
    // commit fails; the row rolls back, the lookup's answer is kept.
    match f.run(&pipeline, "vendor", &job).await {
        ExecutionOutcome::Failed {
            attempt: 1,
            dead: false,
            error,
        } => assert!(error.contains("commit failed once"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(directory.calls(), 1);
    assert_eq!(f.count("SELECT 1 FROM vendors").await, 0);
    assert_eq!(f.count("SELECT 1 FROM stage_checkpoints").await, 1);

    // The second attempt reuses the answer: no second call.
    assert!(matches!(
        f.run(&pipeline, "vendor", &job).await,
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    assert_eq!(directory.calls(), 1);
    assert_eq!(f.count("SELECT 1 FROM vendors").await, 1);
    assert_eq!(f.count("SELECT 1 FROM stage_checkpoints").await, 0);
    assert!(matches!(
        f.run(&pipeline, "book", &job).await,
        ExecutionOutcome::Succeeded { attempt: 1, .. }
    ));
    assert_eq!(f.count("SELECT 1 FROM invoices").await, 1);
}
