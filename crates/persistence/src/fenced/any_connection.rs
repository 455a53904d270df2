//! The helpers of [`FencedTx`](super::FencedTx) that work on any connection (the
//! caller's transaction), for code outside a stage body: insert-or-get and audit.

use diesel::prelude::*;
use diesel_async::methods::LoadQuery;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ClaimToken, RepoError, RowId, TenantId};

use super::{InsertOrGet, INSERT_OR_GET_TRIES};
use crate::error::map_diesel_error;
use crate::schema::audit_log;

/// [`FencedTx::insert_or_get`](super::FencedTx::insert_or_get) on any connection (the caller's transaction).
pub async fn insert_or_get<'q, Id, I, S>(
    conn: &mut AsyncPgConnection,
    what: &str,
    insert: impl Fn() -> I,
    select: impl Fn() -> S,
) -> Result<InsertOrGet<Id>, RepoError>
where
    Id: Send + 'static,
    I: LoadQuery<'q, AsyncPgConnection, Id> + Send + 'q,
    S: LoadQuery<'q, AsyncPgConnection, Id> + Send + 'q,
{
    for _ in 0..INSERT_OR_GET_TRIES {
        let inserted: Option<Id> = insert()
            .get_result(conn)
            .await
            .optional()
            .map_err(map_diesel_error)?;
        if let Some(id) = inserted {
            return Ok(InsertOrGet { id, inserted: true });
        }
        let existing: Option<Id> = select()
            .get_result(conn)
            .await
            .optional()
            .map_err(map_diesel_error)?;
        if let Some(id) = existing {
            return Ok(InsertOrGet {
                id,
                inserted: false,
            });
        }
    }
    Err(RepoError::InsertOrGetExhausted {
        what: what.to_owned(),
        tries: INSERT_OR_GET_TRIES,
    })
}

/// Appends an audit entry of `tenant` on the caller's connection (in its
/// transaction, if one is open); with `token` the entry names the run and attempt.
/// Returns the entry's id.
pub async fn audit(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    entity_id: &str,
    action: &str,
    token: Option<&ClaimToken>,
    details: serde_json::Value,
) -> Result<RowId, RepoError> {
    use audit_log::dsl as a;
    let id = RowId::new();
    diesel::insert_into(a::audit_log)
        .values((
            a::id.eq(id.to_string()),
            a::tenant_id.eq(tenant.as_str()),
            a::entity_id.eq(entity_id),
            a::action.eq(action),
            a::run_id.eq(token.map(|t| t.run_id.to_string())),
            a::attempt.eq(token.map(|t| t.attempt)),
            a::details.eq(details),
        ))
        .execute(conn)
        .await
        .map_err(map_diesel_error)?;
    Ok(id)
}
