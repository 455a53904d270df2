//! The ring of open items (`items_open`, migration
//! `2026-12-06-020000_open_items_ring`): items are opened in the current
//! slot; a round of the reconciler [`rotate`]s to the next one, then passes
//! each older slot ([`seal`] first, then [`open_items`] in batches), opens
//! again in the current slot every item it does not find settled ([`carry`]),
//! and [`truncate`]s the slot. Nothing is deleted or updated.

use diesel::sql_types::{Array, BigInt, Bool, Integer, SmallInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, RepoError, TenantId};

use super::OpenItem;
use crate::error::map_diesel_error;

/// The slots of the ring of open items.
pub const OPEN_SLOTS: i16 = 4;

#[derive(diesel::QueryableByName)]
struct OpenRow {
    #[diesel(sql_type = Text)]
    tenant_id: String,
    #[diesel(sql_type = Text)]
    item_id: String,
}

/// `$1` the slot, `$2`, `$3` the last item of the previous batch (tenant,
/// item; `''` to start), `$4` the batch's size: the slot's next open items in
/// key order (the primary key).
pub(crate) const OPEN_SQL: &str = "\
SELECT tenant_id, item_id FROM items_open
 WHERE slot = $1 AND (tenant_id, item_id) > ($2::text, $3::text)
 ORDER BY tenant_id, item_id
 LIMIT $4";

/// `$1` the current slot's age in microseconds: the next epoch of the ring
/// once the current slot's oldest item is that old, if the slot it makes
/// current is empty (one rotation at a time); the epoch current now and what
/// the rotation did.
pub(crate) const ROTATE_SQL: &str = "\
SELECT epoch, outcome FROM idemstage_items_open_rotate($1 * interval '1 microsecond')";

/// `$1` the slot: waits for the slot's writers, false for the current slot.
pub(crate) const SEAL_SQL: &str = "SELECT idemstage_items_open_seal($1::smallint) AS done";

/// `$1` the slot: emptied, false if it is the current one again.
pub(crate) const TRUNCATE_SQL: &str = "SELECT idemstage_items_open_truncate($1::smallint) AS done";

/// How long a truncate waits for a reader of its slot.
const TRUNCATE_LOCK_TIMEOUT_SQL: &str = "SELECT set_config('lock_timeout', '200ms', true)";

/// `$1` the tenant, `$2` its items: each opened (again) in the current slot.
pub(crate) const CARRY_SQL: &str = "\
SELECT count(*) AS n FROM (SELECT idemstage_open_item($1, a) FROM unnest($2::text[]) AS a) AS opened";

/// The next `limit` open items of `slot` after `after` (from the start if
/// `None`), in key order, across tenants (as the connecting user: the worker
/// may read this table). Fewer than `limit` means the end was reached.
pub async fn open_items(
    conn: &mut AsyncPgConnection,
    slot: i16,
    after: Option<&OpenItem>,
    limit: u32,
) -> Result<Vec<OpenItem>, RepoError> {
    let (tenant, item) = after.map_or((String::new(), String::new()), |a| {
        (a.tenant.to_string(), a.item.to_string())
    });
    let query = diesel::sql_query(OPEN_SQL)
        .bind::<SmallInt, _>(slot)
        .bind::<Text, _>(tenant)
        .bind::<Text, _>(item)
        .bind::<Integer, _>(i32::try_from(limit.max(1)).unwrap_or(i32::MAX));
    let rows: Vec<OpenRow> = crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)?;
    rows.into_iter()
        .map(|r| {
            Ok(OpenItem {
                tenant: TenantId::parse(&r.tenant_id)?,
                item: ItemId::parse(&r.item_id)?,
            })
        })
        .collect()
}

/// What a round's [`rotate`] did, and so which slots the round passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rotation {
    /// The ring moved on: the round passes every older slot, oldest first.
    Rotated(Vec<i16>),
    /// The slot the ring would move onto still holds items (its truncate
    /// failed): the round passes every older slot again, oldest first.
    Full(Vec<i16>),
    /// The current slot's oldest item is younger than the age asked for (or
    /// it is empty): another round moved the ring on a moment ago, or
    /// nothing was opened since; nothing to pass.
    Recent,
    /// Another round is rotating right now: nothing to pass.
    Busy,
}

impl Rotation {
    /// The slots this round passes, oldest first.
    pub fn slots(&self) -> &[i16] {
        match self {
            Rotation::Rotated(slots) | Rotation::Full(slots) => slots,
            Rotation::Recent | Rotation::Busy => &[],
        }
    }
}

/// A round's start: the ring moves to its next slot once the current slot's
/// oldest item is `min_age` old, unless the next slot still holds items (a
/// slot not yet passed and truncated) or another round is rotating now.
/// Autocommit (a transaction of its own).
pub async fn rotate(
    conn: &mut AsyncPgConnection,
    min_age: std::time::Duration,
) -> Result<Rotation, RepoError> {
    #[derive(diesel::QueryableByName)]
    struct Rotated {
        #[diesel(sql_type = BigInt)]
        epoch: i64,
        #[diesel(sql_type = Text)]
        outcome: String,
    }
    let Rotated { epoch, outcome } = diesel::sql_query(ROTATE_SQL)
        .bind::<BigInt, _>(i64::try_from(min_age.as_micros()).unwrap_or(i64::MAX))
        .get_result(conn)
        .await
        .map_err(map_diesel_error)?;
    let n = i64::from(OPEN_SLOTS);
    let older = || {
        (1..n)
            .map(|k| i16::try_from((epoch + k) % n).unwrap_or_default())
            .collect()
    };
    Ok(match outcome.as_str() {
        "rotated" => Rotation::Rotated(older()),
        "full" => Rotation::Full(older()),
        "recent" => Rotation::Recent,
        _ => Rotation::Busy,
    })
}

#[derive(diesel::QueryableByName)]
struct Done {
    #[diesel(sql_type = Bool)]
    done: bool,
}

/// Before `slot`'s pass, in a transaction of its own (autocommit): waits
/// until every writer that may insert into it has committed. False: the slot
/// is the current one (a rotation since the round began), not to be passed.
pub async fn seal(conn: &mut AsyncPgConnection, slot: i16) -> Result<bool, RepoError> {
    let Done { done } = diesel::sql_query(SEAL_SQL)
        .bind::<SmallInt, _>(slot)
        .get_result(conn)
        .await
        .map_err(map_diesel_error)?;
    Ok(done)
}

/// After `slot`'s pass (every item in it settled or opened again in the
/// current slot): empties it. False: it is the current slot again, or a
/// reader held it past the lock timeout (its next pass truncates it).
pub async fn truncate(conn: &mut AsyncPgConnection, slot: i16) -> Result<bool, RepoError> {
    use diesel_async::AsyncConnection;
    let result = conn
        .transaction::<bool, diesel::result::Error, _>(async |conn| {
            diesel::sql_query(TRUNCATE_LOCK_TIMEOUT_SQL)
                .execute(conn)
                .await?;
            let Done { done } = diesel::sql_query(TRUNCATE_SQL)
                .bind::<SmallInt, _>(slot)
                .get_result(conn)
                .await?;
            Ok(done)
        })
        .await;
    match result {
        Ok(done) => Ok(done),
        Err(e) => match map_diesel_error(e) {
            RepoError::Timeout(msg) => {
                tracing::debug!(slot, %msg, "reconciler: the slot's truncate waits for a reader");
                Ok(false)
            }
            other => Err(other),
        },
    }
}

/// Opens those of `items` of `tenant` that are not in `settled` again in the
/// current slot: a pass found them not settled. Run it inside a transaction
/// scoped to `tenant`.
pub async fn carry(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    items: &[ItemId],
    settled: &[ItemId],
) -> Result<(), RepoError> {
    let settled: std::collections::HashSet<&ItemId> = settled.iter().collect();
    let ids: Vec<String> = items
        .iter()
        .filter(|a| !settled.contains(a))
        .map(ToString::to_string)
        .collect();
    if ids.is_empty() {
        return Ok(());
    }
    diesel::sql_query(CARRY_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Array<Text>, _>(&ids)
        .execute(conn)
        .await
        .map(|_| ())
        .map_err(map_diesel_error)
}
