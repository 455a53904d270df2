//! Ready floors: where the fetch starts reading each lane of ready jobs.
//!
//! A lane is a (queue, tenant, priority); its jobs are ordered by a sequence
//! number drawn whenever a job becomes ready. While a held snapshot keeps vacuum
//! from removing the index entries of jobs already leased, a fetch that read a
//! lane from its start would walk all of them; it reads from the lane's floor
//! instead. Migration `2026-12-04-000000_ready_floors` says how a floor moves and
//! why no ready job stays below one for longer than one run of
//! [`advance_floors`].

use std::time::Duration;

use diesel::sql_types::{BigInt, Nullable};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::RepoError;

use super::millis;
use crate::error::map_diesel_error;

/// One run of the floors: binds `$1` the previous run's mark (int8, NULL for
/// none), `$2` the horizon in ms (int8: jobs due within it hold their lane's
/// floor), `$3` the least time between two raises of a floor in ms (int8).
/// Returns the mark for the next run (`mark`, int8).
pub(crate) const ADVANCE_FLOORS_SQL: &str = "SELECT idemstage_advance_floors($1, $2, $3) AS mark";

/// What [`advance_floors`] hands to its next run: the job sequence's value when
/// this run read it. A job that became ready after it is above every floor the
/// next run sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloorMark(i64);

#[derive(diesel::QueryableByName)]
struct MarkRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    mark: Option<i64>,
}

/// Moves the lanes' floors up to their first ready job (or down to one that
/// became ready below its floor), for a caller that runs this every `interval`
/// with the mark of its previous run (`None` the first time: then floors are only
/// lowered). One run at a time per database (an advisory lock): a run that finds
/// another running changes nothing and gives back `previous`. Run it outside a
/// transaction. The queue worker of `idemstage-runner` runs it every second; a process that fetches by hand needs nothing (without
/// runs the floors stay where they are, and only the walk grows).
pub async fn advance_floors(
    conn: &mut AsyncPgConnection,
    previous: Option<FloorMark>,
    interval: Duration,
) -> Result<Option<FloorMark>, RepoError> {
    // Jobs due within three runs keep their floor where they are, so that a
    // deferred job is above it when it comes due; a floor rises at most every
    // other run, so that a lane's row has few versions for a held snapshot to keep.
    let horizon = millis(interval.saturating_mul(3));
    let raise_every = millis(interval.saturating_mul(2));
    let query = diesel::sql_query(ADVANCE_FLOORS_SQL)
        .bind::<Nullable<BigInt>, _>(previous.map(|m| m.0))
        .bind::<BigInt, _>(horizon)
        .bind::<BigInt, _>(raise_every);
    let row: MarkRow = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(row.mark.map(FloorMark))
}
