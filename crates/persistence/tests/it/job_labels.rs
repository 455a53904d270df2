//! A job's labels agree with its payload (the baseline migration): the tenant label
//! of a payload that names a tenant, and a singleton key of the stage form. The
//! library's send refuses a contradiction with a typed error; the database
//! refuses it from any writer. Neither writes anything.

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{Jsonb, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    DomainError, FailKind, ItemId, JobFailOutcome, JobId, JobToSend, RepoError, SendOptions,
    SendResult, TenantId,
};
use idemstage_persistence::queue;
use idemstage_testkit::{count, TestDb};
use serde_json::{json, Value};

fn job(queue: &str, tenant: Option<&str>, key: Option<&str>, payload: Value) -> JobToSend {
    let mut options = SendOptions::default();
    options.singleton_key = key.map(str::to_owned);
    JobToSend {
        queue: queue.to_owned(),
        tenant: tenant.map(|t| TenantId::parse(t).unwrap()),
        payload,
        options,
    }
}

async fn insert_by_hand(
    conn: &mut AsyncPgConnection,
    tenant: &str,
    key: Option<&str>,
    payload: Value,
) -> Result<usize, DieselError> {
    diesel::sql_query(
        "INSERT INTO jobs (id, queue, tenant_id, singleton_key, payload)
         VALUES ($1, 'extract', $2, $3, $4)",
    )
    .bind::<Text, _>(JobId::new().to_string())
    .bind::<Text, _>(tenant)
    .bind::<Nullable<Text>, _>(key)
    .bind::<Jsonb, _>(payload)
    .execute(conn)
    .await
}

/// A stage job's payload of `tenant` and `item`.
fn stage_payload(tenant: &str, item: ItemId) -> Value {
    json!({ "tenant_id": tenant, "item_id": item.to_string(), "input_hash": "a".repeat(64) })
}

#[tokio::test]
async fn a_job_labelled_with_another_tenant_than_its_payloads_is_refused() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let a = ItemId::new();
    let key = format!("extract:t1:{a}");
    let other_key = format!("extract:t1:{}", ItemId::new());
    let refused = [
        // Labelled t2 (or nothing) but working for t1: it would escape t1's pause and caps.
        (
            "label t2",
            job("extract", Some("t2"), None, stage_payload("t1", a)),
        ),
        (
            "no label",
            job("extract", None, None, stage_payload("t1", a)),
        ),
        // The stage key of (t1, a), held by a job of another item or tenant.
        (
            "another item",
            job(
                "extract",
                Some("t1"),
                Some(&other_key),
                stage_payload("t1", a),
            ),
        ),
        (
            "key of t1, job of t2",
            job("extract", Some("t2"), Some(&key), stage_payload("t2", a)),
        ),
        (
            "no stage payload",
            job("extract", Some("t1"), Some(&key), json!({ "x": 1 })),
        ),
    ];
    for (what, job) in &refused {
        let err = queue::send_in(&mut conn, job).await.unwrap_err();
        assert!(
            matches!(err, RepoError::Invalid(DomainError::InvalidPayload(_))),
            "{what}: {err:?}"
        );
        assert!(err.is_bad_request(), "{what}");
        let err = queue::send_batch(&mut conn, std::slice::from_ref(job))
            .await
            .unwrap_err();
        assert!(matches!(err, RepoError::Invalid(_)), "{what}: {err:?}");
        // Written by hand, past the library: the database refuses it.
        let label = job.tenant.as_ref().map_or("", |t| t.as_str());
        let err = insert_by_hand(
            &mut conn,
            label,
            job.options.singleton_key.as_deref(),
            job.payload.clone(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(
                err,
                DieselError::DatabaseError(DatabaseErrorKind::CheckViolation, _)
            ),
            "{what}: {err:?}"
        );
    }
    // Nor may a job be relabelled afterwards.
    let id = match queue::send_in(
        &mut conn,
        &job("extract", Some("t1"), Some(&key), stage_payload("t1", a)),
    )
    .await
    .unwrap()
    {
        SendResult::Sent(id) => id,
        SendResult::Duplicate => panic!("duplicate"),
    };
    let err = diesel::sql_query("UPDATE jobs SET tenant_id = 't2' WHERE id = $1")
        .bind::<Text, _>(id.to_string())
        .execute(&mut conn)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DieselError::DatabaseError(DatabaseErrorKind::CheckViolation, _)
        ),
        "{err:?}"
    );
    assert_eq!(count(&mut conn, "SELECT 1 FROM jobs").await, 1);
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM jobs WHERE tenant_id = 't1'").await,
        1
    );
}

/// What stays allowed: generic jobs without a tenant in their payload, a tenant
/// that is no slug (no tenant: the handler refuses the payload), keys that are
/// not of the stage form; a worker login role sends a stage job (the trigger
/// opens its item for the reconciler with the sender's rights); a failed
/// job's dead-letter copy keeps the label.
#[tokio::test]
async fn generic_jobs_and_consistent_stage_jobs_are_sent() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let a = ItemId::new();
    for job in [
        job(
            "emails",
            None,
            Some("emails:t1:whatever"),
            json!({ "to": "x" }),
        ),
        job("emails", None, None, json!({ "tenant_id": "Not A Slug" })),
        job("emails", None, None, json!(["tenant_id", "t1"])),
        job(
            "emails",
            Some("t1"),
            Some("t1-invoice-7"),
            json!({ "tenant_id": "t1" }),
        ),
    ] {
        assert!(
            matches!(
                queue::send_in(&mut conn, &job).await.unwrap(),
                SendResult::Sent(_)
            ),
            "{job:?}"
        );
    }
    let mut worker = idemstage_persistence::connect(&db.worker_url())
        .await
        .unwrap();
    let key = format!("extract:t1:{a}");
    let mut options = SendOptions::default()
        .with_singleton_key(key)
        .with_dead_letter("extract_dead");
    options.retry_limit = 0;
    let stage_job = JobToSend {
        options,
        ..job("extract", Some("t1"), None, stage_payload("t1", a))
    };
    assert!(matches!(
        queue::send_in(&mut worker, &stage_job).await.unwrap(),
        SendResult::Sent(_)
    ));
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT 1 FROM items_open WHERE tenant_id = 't1' AND item_id = '{a}'")
        )
        .await,
        1
    );
    let fetched = queue::fetch(&mut worker, &["extract".to_owned()], 1)
        .await
        .unwrap();
    let outcome = queue::fail(
        &mut worker,
        fetched[0].id,
        fetched[0].attempt,
        "no",
        FailKind::Permanent,
    )
    .await
    .unwrap();
    assert!(
        matches!(
            outcome,
            JobFailOutcome::Failed {
                dead_lettered: Some(_)
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM jobs WHERE queue = 'extract_dead' AND tenant_id = 't1'"
        )
        .await,
        1
    );
}
