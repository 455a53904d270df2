//! Registering an anfrage and its input.

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{input_hash_of, AnfrageId, DomainError, RepoError, TenantId};
use serde::Serialize;

use crate::error::map_diesel_error;
use crate::schema::anfragen;

/// The most input text an anfrage may carry.
pub const MAX_INPUT_BYTES: usize = 1024 * 1024;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum RegisterOutcome {
    Created {
        input_sha256: String,
    },
    /// Sending the same anfrage again is normal; `input_sha256` is the stored one.
    AlreadyRegistered {
        input_sha256: String,
        same_input: bool,
    },
}

impl RegisterOutcome {
    pub fn input_sha256(&self) -> &str {
        match self {
            RegisterOutcome::Created { input_sha256 }
            | RegisterOutcome::AlreadyRegistered { input_sha256, .. } => input_sha256,
        }
    }
}

/// Refuses an empty or oversized input (checked again by `register_anfrage`; callers
/// use this to fail before they connect).
pub fn validate_input(input_text: &str) -> Result<(), DomainError> {
    if input_text.trim().is_empty() {
        return Err(DomainError::EmptyInput);
    }
    if input_text.len() > MAX_INPUT_BYTES {
        return Err(DomainError::InputTooLarge {
            size: input_text.len(),
            max: MAX_INPUT_BYTES,
        });
    }
    Ok(())
}

/// Registers an anfrage if new (insert-or-get on its id). An id that belongs to
/// another tenant is refused with `TenantMismatch`; nothing is written then.
pub async fn register_anfrage(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    anfrage: &AnfrageId,
    input_text: &str,
) -> Result<RegisterOutcome, RepoError> {
    use anfragen::dsl as a;
    validate_input(input_text)?;
    let sha = input_hash_of(input_text.as_bytes());
    let s3_key = format!("anfragen/{tenant}/{anfrage}/input.txt");
    // Scoped to the tenant (row-level security): another tenant's row with this id
    // is invisible here, so a conflict with no visible row means "not yours".
    let existing = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            crate::tenant::scope(conn, tenant).await?;
            let inserted = diesel::insert_into(a::anfragen)
                .values((
                    a::tenant_id.eq(tenant.as_str()),
                    a::id.eq(anfrage.to_string()),
                    a::input_text.eq(input_text),
                    a::input_sha256.eq(&sha),
                    a::s3_key.eq(&s3_key),
                ))
                // No conflict target: a concurrent insert of the same id can trip the
                // (tenant_id, id) unique index before the primary key, and only the
                // arbiter indexes of ON CONFLICT are forgiven. Any conflict means the
                // id exists; the read below says whose it is.
                .on_conflict_do_nothing()
                .execute(conn)
                .await?;
            if inserted == 1 {
                return Ok(None);
            }
            a::anfragen
                .filter(a::id.eq(anfrage.to_string()))
                .select((a::tenant_id, a::input_sha256))
                .first::<(String, String)>(conn)
                .await
                .optional()
                .map(Some)
        })
        .await
        .map_err(map_diesel_error)?;
    match existing {
        None => Ok(RegisterOutcome::Created { input_sha256: sha }),
        Some(Some((owner, stored))) if owner == tenant.as_str() => {
            Ok(RegisterOutcome::AlreadyRegistered {
                same_input: stored == sha,
                input_sha256: stored,
            })
        }
        // Anfragen are never deleted: an id that conflicted but is not visible (or
        // visible under another tenant) belongs to another tenant.
        Some(_) => Err(RepoError::TenantMismatch {
            tenant: tenant.to_string(),
            anfrage: anfrage.to_string(),
        }),
    }
}
