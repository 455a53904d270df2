//! Starting a pipeline for an item: register its input and send the first job
//! in one transaction, under the first stage's input policy.

use diesel_async::{AsyncConnection, RunQueryDsl};
use idemstage_domain::{
    input_hash_of, InputChangePolicy, ItemId, JobToSend, RepoError, SendOptions, SendResult,
};
use idemstage_persistence::items::{start_in, RegisterOutcome, StartOutcome};
use idemstage_persistence::TxError;
use idemstage_testkit::TestDb;

use crate::support::*;

fn job(item: ItemId, hash: &str) -> JobToSend {
    JobToSend {
        // The job of the scope's tenant: in start_in's transaction it is sent in
        // the tenant scope (the baseline migration).
        tenant: Some(tenant("t1")),
        queue: "intake".into(),
        payload: serde_json::json!({ "tenant_id": "t1", "item_id": item, "input_hash": hash }),
        options: SendOptions::default().with_singleton_key(format!("intake:t1:{item}")),
    }
}

async fn start(
    conn: &mut diesel_async::AsyncPgConnection,
    item: ItemId,
    text: &str,
    policy: InputChangePolicy,
) -> Result<StartOutcome, RepoError> {
    conn.transaction::<_, TxError, _>(async |conn| {
        Ok(start_in(conn, &tenant("t1"), &item, text, policy, |h| job(item, h)).await?)
    })
    .await
    .map_err(TxError::into_repo)
}

async fn stored(conn: &mut diesel_async::AsyncPgConnection) -> (String, String, String) {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        input_text: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        input_sha256: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        payload_hash: String,
    }
    let r: Row = diesel::sql_query(
        "SELECT a.input_text, a.input_sha256, j.payload->>'input_hash' AS payload_hash
           FROM items a, jobs j WHERE j.state IN ('created', 'retry', 'active')",
    )
    .get_result(conn)
    .await
    .unwrap();
    (r.input_text, r.input_sha256, r.payload_hash)
}

#[tokio::test]
async fn another_input_is_refused_under_reject_and_replaces_under_rerun() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let item = ItemId::new();
    let first = start(&mut conn, item, TEXT_A, InputChangePolicy::Reject)
        .await
        .unwrap();
    assert!(matches!(first.registered, RegisterOutcome::Created { .. }));
    assert!(matches!(first.sent, SendResult::Sent(_)));

    // Reject: refused, typed, and nothing changes.
    let err = start(&mut conn, item, TEXT_B, InputChangePolicy::Reject)
        .await
        .unwrap_err();
    assert!(matches!(err, RepoError::InputChanged { .. }), "{err:?}");
    assert!(!err.is_retryable());
    assert_eq!(
        stored(&mut conn).await,
        (TEXT_A.to_owned(), hash_a(), hash_a())
    );

    // Rerun: the text and hash are replaced, and the still-live job (the send is a
    // duplicate) now carries the new input, so the new input is not swallowed.
    let replaced = start(&mut conn, item, TEXT_B, InputChangePolicy::Rerun)
        .await
        .unwrap();
    assert_eq!(
        replaced,
        StartOutcome {
            registered: RegisterOutcome::Replaced {
                previous_sha256: hash_a(),
                input_sha256: hash_b(),
            },
            sent: SendResult::Duplicate,
        }
    );
    assert_eq!(
        stored(&mut conn).await,
        (TEXT_B.to_owned(), hash_b(), hash_b())
    );
    assert_eq!(count(&mut conn, "SELECT 1 FROM jobs").await, 1);
    assert_eq!(input_hash_of(TEXT_B.as_bytes()), hash_b());
    // A second replacement with the same text is just a repeat.
    diesel::sql_query("UPDATE jobs SET state = 'completed'")
        .execute(&mut conn)
        .await
        .unwrap();
    let repeat = start(&mut conn, item, TEXT_B, InputChangePolicy::Rerun)
        .await
        .unwrap();
    assert!(matches!(
        repeat.registered,
        RegisterOutcome::AlreadyRegistered {
            same_input: true,
            ..
        }
    ));
}
