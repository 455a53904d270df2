//! Ready floors: where the fetch starts reading each lane of ready jobs.
//!
//! A lane is a (queue, tenant, priority); its jobs are ordered by a sequence
//! number drawn whenever a job becomes ready. While a held snapshot keeps vacuum
//! from removing the index entries of jobs already leased, a fetch that read a
//! lane from its start would walk all of them; it reads from the lane's floor
//! instead. Migration `2026-12-04-000000_ready_floors` says how a floor moves;
//! `2026-12-05-030000_floors_under_a_hold` how a ready job below its floor is
//! found (a deferred one by the next run once due, one whose sending
//! transaction outlived a run by the next run that walks below the floors).

use std::time::Duration;

use diesel::sql_types::{BigInt, Bool, Nullable};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::RepoError;

use super::millis;
use crate::error::map_diesel_error;

/// One run of the floors: binds `$1` the previous run's mark (int8, NULL for
/// none), `$2` the horizon in ms (int8: jobs due within it hold their lane's
/// floor), `$3` the least time between two raises of a floor in ms (int8), `$4`
/// whether to walk each lane below its floor (bool). Returns the mark for the
/// next run (`mark`, int8).
pub(crate) const ADVANCE_FLOORS_SQL: &str =
    "SELECT idemstage_advance_floors($1, $2, $3, $4) AS mark";

/// Every how many runs of a caller [`advance_floors`] walks each lane from its
/// start, to find a job whose sending transaction outlived a run (the floor
/// passed it before it committed); its first run walks too. The other runs read
/// each lane from its floor, plus the index of jobs that were not due when they
/// became ready: under a held snapshot a walk from the start passes every job
/// leased since the hold began.
pub const WALK_BELOW_EVERY: u32 = 30;

/// What [`advance_floors`] hands to its next run: the job sequence's value when
/// this run read it (a job that became ready after it is above every floor the
/// next run sets), and how many runs came before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FloorMark {
    mark: i64,
    runs: u32,
}

#[derive(diesel::QueryableByName)]
struct MarkRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    mark: Option<i64>,
}

/// Moves the lanes' floors up to their first ready job (or down to one that
/// became ready below its floor), for a caller that runs this every `interval`
/// with the mark of its previous run (`None` the first time: then floors are only
/// lowered). A job deferred past the horizon is found below its floor by the
/// next run once due; one whose sending transaction outlived a run, by the next
/// run that walks below the floors (every [`WALK_BELOW_EVERY`]th). One run at
/// a time per database (an advisory lock): a run that finds another running
/// changes nothing and gives back `previous`. Run it outside a transaction.
/// The queue worker of `idemstage-runner` runs it every second; a process that
/// fetches by hand needs nothing (without runs the floors stay where they are,
/// and only the walk grows).
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
    let runs = previous.map_or(0, |m| m.runs.wrapping_add(1));
    let query = diesel::sql_query(ADVANCE_FLOORS_SQL)
        .bind::<Nullable<BigInt>, _>(previous.map(|m| m.mark))
        .bind::<BigInt, _>(horizon)
        .bind::<BigInt, _>(raise_every)
        .bind::<Bool, _>(runs % WALK_BELOW_EVERY == 0);
    let row: MarkRow = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(row.mark.map(|mark| FloorMark { mark, runs }))
}
