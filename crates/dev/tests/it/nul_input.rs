//! An item input PostgreSQL cannot store as text (a NUL character), given to
//! the library's `start` and `start_in`: refused with a typed error before
//! anything is written. (`idemstage enqueue --file` of such a file: `cli.rs`.)

use diesel::sql_types::BigInt;
use diesel_async::{AsyncConnection, RunQueryDsl};
use idemstage::{db::RepoError, ids::DomainError, ids::ItemId, ids::TenantId};

const ITEM: &str = "01JDQ3W5AAAAAAAAAAAAAAAAAA";

async fn rows(db: &idemstage_testkit::TestDb) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    diesel::sql_query("SELECT (SELECT count(*) FROM items) + (SELECT count(*) FROM jobs) AS n")
        .get_result::<N>(&mut db.conn().await)
        .await
        .unwrap()
        .n
}

/// Item 9 of issue 29, the library path: `start` and `start_in` refuse an input
/// holding a NUL byte with a typed error before writing (it was the raw 22021
/// error, which also aborted a caller's transaction around `start_in`).
#[tokio::test]
async fn an_input_with_a_nul_byte_is_refused_by_start_and_start_in() {
    let db = idemstage_harness::example::db().await;
    let pipeline = crate::support::pipeline();
    let (tenant, item) = (TenantId::parse("t1").unwrap(), ItemId::parse(ITEM).unwrap());
    let text = "1 Stk\0Schrauben";
    let refused = |e: &RepoError| {
        matches!(
            e,
            RepoError::Invalid(DomainError::InputContainsNul { at: 5 })
        )
    };
    let pool = db.pool(1).await;
    let e = idemstage::pipeline::start(&pool, &pipeline, &tenant, &item, text)
        .await
        .unwrap_err();
    assert!(refused(&e) && e.is_bad_request(), "{e:?}");
    // Inside a caller's transaction: refused before any statement, so the
    // transaction goes on and the good input starts in it.
    let mut conn = db.conn().await;
    conn.transaction::<_, idemstage::runs::TxError, _>(async |conn| {
        let e = idemstage::pipeline::start_in(conn, &pipeline, &tenant, &item, text)
            .await
            .unwrap_err();
        assert!(refused(&e), "{e:?}");
        idemstage::pipeline::start_in(conn, &pipeline, &tenant, &item, "1 Stk Schrauben").await?;
        Ok(())
    })
    .await
    .unwrap();
    assert_eq!(rows(&db).await, 2, "the good input's item and job only");
}
