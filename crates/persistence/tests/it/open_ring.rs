//! The reconciler's ring of open items (`items_open`, migration
//! `2026-12-06-020000_open_items_ring`): a passed slot is emptied by its
//! truncate, an item not settled is opened again in the current slot, and the
//! ring never moves onto a slot that still holds items. (That no role may
//! delete an open item: `tenant_isolation`.)

use diesel::sql_types::{BigInt, SmallInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::ItemId;
use std::time::Duration;

use idemstage_persistence::reconcile::{self, Rotation};
use idemstage_persistence::{tenant, TxError};
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
    let now = Duration::ZERO;
    assert_eq!(
        reconcile::rotate(&mut conn, now).await.unwrap(),
        Rotation::Rotated(vec![2, 3, 0])
    );
    assert!(
        !reconcile::seal(&mut conn, 1).await.unwrap(),
        "the current slot"
    );
    assert!(reconcile::seal(&mut conn, 0).await.unwrap());
    let batch = reconcile::open_items(&mut conn, 0, None, 10).await.unwrap();
    assert_eq!(batch.len(), 2);
    // x is still open, y settled: x is opened again in the current slot.
    tenant::transaction::<_, TxError, _>(&mut conn, &t, async |c| {
        Ok(reconcile::carry(c, &t, &[x, y], &[y]).await?)
    })
    .await
    .unwrap();
    assert!(reconcile::truncate(&mut conn, 0).await.unwrap());
    assert_eq!(open_rows(&mut conn).await, [(1, id(x))]);
    // The current slot is never truncated.
    assert!(!reconcile::truncate(&mut conn, 1).await.unwrap());
    assert_eq!(open_rows(&mut conn).await, [(1, id(x))]);

    // A current slot younger than the age asked for stays (another round
    // moved the ring on a moment ago): nothing to pass.
    assert_eq!(
        reconcile::rotate(&mut conn, Duration::from_secs(3600))
            .await
            .unwrap(),
        Rotation::Recent
    );
    assert_eq!(epoch(&mut conn).await, 1);

    // Rounds over empty slots: nothing opened in them, nothing to pass.
    assert_eq!(
        reconcile::rotate(&mut conn, now).await.unwrap(),
        Rotation::Rotated(vec![3, 0, 1])
    );
    assert_eq!(
        reconcile::rotate(&mut conn, now).await.unwrap(),
        Rotation::Recent
    );
    // Two more epochs (an item opened in each and passed): the ring would move
    // onto slot 1, which still holds x, and does not: the round passes the
    // older slots again.
    for epoch_now in [2, 3] {
        let z = new_item(&mut conn, &t).await;
        assert_eq!(
            open_rows(&mut conn)
                .await
                .iter()
                .filter(|r| r.1 == id(z))
                .count(),
            1
        );
        let rotation = reconcile::rotate(&mut conn, now).await.unwrap();
        assert!(matches!(rotation, Rotation::Rotated(_)), "{rotation:?}");
        let slot = i16::try_from(epoch_now % 4).unwrap();
        assert!(reconcile::seal(&mut conn, slot).await.unwrap());
        assert!(reconcile::truncate(&mut conn, slot).await.unwrap());
    }
    assert_eq!(epoch(&mut conn).await, 4);
    let w = new_item(&mut conn, &t).await;
    assert_eq!(
        reconcile::rotate(&mut conn, now).await.unwrap(),
        Rotation::Full(vec![1, 2, 3])
    );
    assert_eq!(
        epoch(&mut conn).await,
        4,
        "moved onto a slot that holds an item"
    );
    assert!(reconcile::seal(&mut conn, 1).await.unwrap());
    assert!(reconcile::truncate(&mut conn, 1).await.unwrap());
    assert_eq!(
        reconcile::rotate(&mut conn, now).await.unwrap(),
        Rotation::Rotated(vec![2, 3, 0])
    );
    assert_eq!(epoch(&mut conn).await, 5);
    assert_eq!(open_rows(&mut conn).await, [(0, id(w))]);
}
