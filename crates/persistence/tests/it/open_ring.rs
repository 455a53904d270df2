//! The reconciler's ring of open items (`items_open`, migration
//! `2026-12-06-020000_open_items_ring`): a passed slot is emptied by its
//! truncate, an item not settled is opened again in the current slot, and the
//! ring never moves onto a slot that still holds items. (That no role may
//! delete an open item: `tenant_isolation`.)

use diesel::sql_types::{BigInt, SmallInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::ItemId;
use idemstage_persistence::{reconcile, tenant, TxError};
use idemstage_testkit::TestDb;

use crate::support::*;

#[derive(diesel::QueryableByName, Debug, PartialEq)]
struct Open {
    #[diesel(sql_type = SmallInt)]
    slot: i16,
    #[diesel(sql_type = Text)]
    item_id: String,
}

async fn open_rows(conn: &mut AsyncPgConnection) -> Vec<(i16, String)> {
    let rows: Vec<Open> =
        diesel::sql_query("SELECT slot, item_id FROM items_open ORDER BY slot, item_id")
            .load(conn)
            .await
            .unwrap();
    rows.into_iter().map(|r| (r.slot, r.item_id)).collect()
}

async fn epoch(conn: &mut AsyncPgConnection) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Epoch {
        #[diesel(sql_type = BigInt)]
        last_value: i64,
    }
    diesel::sql_query("SELECT last_value FROM items_open_epoch")
        .get_result::<Epoch>(conn)
        .await
        .unwrap()
        .last_value
}

#[tokio::test]
async fn a_round_carries_what_is_open_and_truncates_what_it_passed() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let (x, y) = (new_item(&mut conn, &t).await, new_item(&mut conn, &t).await);
    let id = |a: ItemId| a.to_string();
    // Registered in epoch 0: slot 0.
    let mut want = vec![(0, id(x)), (0, id(y))];
    want.sort();
    assert_eq!(open_rows(&mut conn).await, want);

    // The round: the ring moves to slot 1; the older slots, oldest first.
    assert_eq!(reconcile::rotate(&mut conn).await.unwrap(), [2, 3, 0]);
    assert!(
        !reconcile::seal(&mut conn, 1).await.unwrap(),
        "the current slot"
    );
    assert!(reconcile::seal(&mut conn, 0).await.unwrap());
    let batch = reconcile::open_items(&mut conn, 0, None, 10).await.unwrap();
    assert_eq!(batch.len(), 2);
    // x is still open (not settled): opened again in the current slot.
    tenant::transaction::<_, TxError, _>(&mut conn, &t, async |c| {
        Ok(reconcile::carry(c, &t, &[x]).await?)
    })
    .await
    .unwrap();
    assert!(reconcile::truncate(&mut conn, 0).await.unwrap());
    assert_eq!(open_rows(&mut conn).await, [(1, id(x))]);
    // The current slot is never truncated.
    assert!(!reconcile::truncate(&mut conn, 1).await.unwrap());
    assert_eq!(open_rows(&mut conn).await, [(1, id(x))]);

    // Rounds that pass nothing: the ring goes on to slot 0 (epoch 4), and not
    // onto slot 1, which holds x, until x's slot was passed.
    for _ in 0..3 {
        reconcile::rotate(&mut conn).await.unwrap();
    }
    assert_eq!(epoch(&mut conn).await, 4);
    assert_eq!(reconcile::rotate(&mut conn).await.unwrap(), [1, 2, 3]);
    assert_eq!(
        epoch(&mut conn).await,
        4,
        "moved onto a slot that holds an item"
    );
    assert!(reconcile::seal(&mut conn, 1).await.unwrap());
    assert!(reconcile::truncate(&mut conn, 1).await.unwrap());
    assert_eq!(reconcile::rotate(&mut conn).await.unwrap(), [2, 3, 0]);
    assert_eq!(epoch(&mut conn).await, 5);
}
