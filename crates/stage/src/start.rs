//! Starting a pipeline for an item: its input registered and its first stage's
//! job sent, in one transaction.

use diesel_async::{AsyncConnection, AsyncPgConnection};
use idemstage_domain::{ItemId, RepoError, TenantId};
use idemstage_persistence::items::{self, StartOutcome};
use idemstage_persistence::{PgPool, TxError};

use crate::{first_job, Pipeline};

/// Registers `input` for the item and sends the pipeline's first job, inside
/// the caller's open transaction on `conn`: the caller's own writes and the start
/// commit together, or not at all. The first stage's input policy decides about an
/// item registered with another input (`Reject`: `RepoError::InputChanged`,
/// nothing changes; `Rerun`: the input is replaced). Sending again is normal: the
/// outcome says `Duplicate` while a job is live, and a finished first stage skips
/// at the claim.
pub async fn start_in(
    conn: &mut AsyncPgConnection,
    pipeline: &Pipeline,
    tenant: &TenantId,
    item: &ItemId,
    input: &str,
) -> Result<StartOutcome, RepoError> {
    let policy = pipeline.first_stage().policy().on_input_change;
    items::start_in(conn, tenant, item, input, policy, |hash| {
        first_job(pipeline, tenant.clone(), *item, hash.to_owned())
    })
    .await
}

/// [`start_in`] in a transaction of its own, on a pooled connection: the usual
/// way to hand an item to a pipeline. Safe to call again for the same item
/// and input (a duplicate send is an outcome, not an error). A
/// `RepoError::is_retryable` error may be retried as is; `is_bad_request` ones
/// (another input under `Reject`, another tenant's item, an empty or too
/// large input, one holding a NUL character) will fail again.
///
/// ```no_run
/// use idemstage::{pipeline::start, ids::ItemId, pipeline::Pipeline, db::PgPool, queue::SendResult, ids::TenantId};
///
/// # async fn demo(pool: PgPool, pipeline: Pipeline) -> Result<(), Box<dyn std::error::Error>> {
/// let tenant = TenantId::parse("acme")?;
/// let item = ItemId::new();
/// let outcome = start(&pool, &pipeline, &tenant, &item, "10 Stk Schrauben M8").await?;
/// assert!(matches!(outcome.sent, SendResult::Sent(_)));
///
/// // The same start again: registered already, its first job still live.
/// let again = start(&pool, &pipeline, &tenant, &item, "10 Stk Schrauben M8").await?;
/// assert_eq!(again.sent, SendResult::Duplicate);
/// # Ok(())
/// # }
/// ```
pub async fn start(
    pool: &PgPool,
    pipeline: &Pipeline,
    tenant: &TenantId,
    item: &ItemId,
    input: &str,
) -> Result<StartOutcome, RepoError> {
    items::validate_input(input)?;
    let mut conn = idemstage_persistence::get(pool).await?;
    conn.transaction::<_, TxError, _>(async |conn| {
        Ok(start_in(conn, pipeline, tenant, item, input).await?)
    })
    .await
    .map_err(TxError::into_repo)
}
