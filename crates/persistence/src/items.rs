//! Registering an item and its input.

use diesel::prelude::*;
use diesel::sql_types::{Jsonb, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    input_hash_of, DomainError, InputChangePolicy, ItemId, JobToSend, RepoError, SendResult,
    TenantId,
};
use serde::Serialize;

use crate::error::map_diesel_error;
use crate::schema::items;

/// The most input text an item may carry.
pub const MAX_INPUT_BYTES: usize = 1024 * 1024;

/// What registering an item did. Every variant names the SHA-256 (hex) of the
/// input stored afterwards ([`RegisterOutcome::input_sha256`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum RegisterOutcome {
    /// The item was new: its row was inserted with this input.
    Created {
        /// SHA-256 (hex) of the input, now stored.
        input_sha256: String,
    },
    /// Sending the same item again is normal; `input_sha256` is the stored one.
    AlreadyRegistered {
        /// SHA-256 (hex) of the stored input, which was left as it was.
        input_sha256: String,
        /// Whether the input passed has the stored hash. `false` only from
        /// [`register_item`]: [`register_input`] refuses or replaces a changed
        /// input instead.
        same_input: bool,
    },
    /// The item had another input, and its first stage's policy is `Rerun`: the
    /// stored text and hash were replaced by the new ones.
    Replaced {
        /// SHA-256 (hex) of the input that was replaced.
        previous_sha256: String,
        /// SHA-256 (hex) of the new input, now stored.
        input_sha256: String,
    },
}

impl RegisterOutcome {
    /// SHA-256 (hex) of the input stored after the call: the hash a first-stage job
    /// must carry to be claimed (any other is `Rejected(InputMismatch)`).
    pub fn input_sha256(&self) -> &str {
        match self {
            RegisterOutcome::Created { input_sha256 }
            | RegisterOutcome::AlreadyRegistered { input_sha256, .. }
            | RegisterOutcome::Replaced { input_sha256, .. } => input_sha256,
        }
    }
}

/// Refuses an empty or oversized input, and one holding a NUL character, which
/// PostgreSQL text cannot store (its 22021 error would come from the INSERT, and
/// abort the caller's transaction). Checked again by `register_item`; callers
/// use this to fail before they connect.
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
    if let Some(at) = input_text.bytes().position(|b| b == 0) {
        return Err(DomainError::InputContainsNul { at });
    }
    Ok(())
}

/// Registers an item if new (insert-or-get on its id). An id that belongs to
/// another tenant is refused with `TenantMismatch`; nothing is written then.
///
/// Never changes a stored input: another input is reported as
/// `AlreadyRegistered { same_input: false }` (use [`register_input`] to apply the
/// stage's input policy). An empty or oversized input, or one holding a NUL, is
/// `Invalid`. Runs in a transaction scoped to `tenant` (a savepoint inside the
/// caller's transaction; the scope then lasts until the caller's transaction
/// ends).
pub async fn register_item(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    input_text: &str,
) -> Result<RegisterOutcome, RepoError> {
    use items::dsl as a;
    validate_input(input_text)?;
    let sha = input_hash_of(input_text.as_bytes());
    let s3_key = format!("items/{tenant}/{item}/input.txt");
    // Scoped to the tenant (row-level security): another tenant's row with this id
    // is invisible here, so a conflict with no visible row means "not yours".
    let existing =
        crate::tenant::transaction::<_, diesel::result::Error, _>(conn, tenant, async |conn| {
            let inserted = diesel::insert_into(a::items)
                .values((
                    a::tenant_id.eq(tenant.as_str()),
                    a::id.eq(item.to_string()),
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
            a::items
                .filter(a::id.eq(item.to_string()))
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
        // Items are never deleted: an id that conflicted but is not visible (or
        // visible under another tenant) belongs to another tenant.
        Some(_) => Err(RepoError::TenantMismatch {
            tenant: tenant.to_string(),
            item: item.to_string(),
        }),
    }
}

/// Registers an item with its input under the first stage's input policy: a new
/// item is created; the same input again is fine; another input is refused with
/// `InputChanged` under `Reject` (nothing changes) and replaces the stored text and
/// hash under `Rerun`. Run it inside the transaction that sends the first job.
/// A replacement that races another one for the same item is refused with
/// `Conflict` (retryable) rather than overwriting it.
pub async fn register_input(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    input_text: &str,
    policy: InputChangePolicy,
) -> Result<RegisterOutcome, RepoError> {
    use items::dsl as a;
    let registered = register_item(conn, tenant, item, input_text).await?;
    let RegisterOutcome::AlreadyRegistered {
        input_sha256: stored,
        same_input: false,
    } = registered
    else {
        return Ok(registered);
    };
    let new = input_hash_of(input_text.as_bytes());
    if policy == InputChangePolicy::Reject {
        return Err(RepoError::InputChanged {
            tenant: tenant.to_string(),
            item: item.to_string(),
            stored_hash: stored,
            new_hash: new,
        });
    }
    // Conditional on the hash just read: a concurrent replacement wins, and this
    // one is refused rather than silently overwriting it.
    let replaced =
        crate::tenant::transaction::<_, diesel::result::Error, _>(conn, tenant, async |conn| {
            diesel::update(
                a::items
                    .filter(a::tenant_id.eq(tenant.as_str()))
                    .filter(a::id.eq(item.to_string()))
                    .filter(a::input_sha256.eq(&stored)),
            )
            .set((a::input_text.eq(input_text), a::input_sha256.eq(&new)))
            .execute(conn)
            .await
        })
        .await
        .map_err(map_diesel_error)?;
    if replaced != 1 {
        return Err(RepoError::Conflict(
            format!("the input of item {item} changed concurrently").into(),
        ));
    }
    Ok(RegisterOutcome::Replaced {
        previous_sha256: stored,
        input_sha256: new,
    })
}

/// What `start_in` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StartOutcome {
    /// What registering the input did (as [`register_input`]).
    pub registered: RegisterOutcome,
    /// The send of the first stage's job. `Duplicate`: a job with the same
    /// singleton key is live (after a `Replaced` input that live job now carries
    /// the new payload) or, with `singleton_seconds`, was sent in this window.
    pub sent: SendResult,
}

/// Registers the item's input (`register_input`) and sends its first stage's
/// job, in the caller's transaction: both commit together or not at all. `job`
/// builds the job from the stored input's hash. When the input was replaced and a
/// job for the stage is still live (the send is a duplicate), that job is pointed
/// at the new input (payload, and a fresh retry budget), so that no send of a new
/// input is swallowed by an older job.
pub async fn start_in(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    input_text: &str,
    policy: InputChangePolicy,
    job: impl FnOnce(&str) -> JobToSend,
) -> Result<StartOutcome, RepoError> {
    let registered = register_input(conn, tenant, item, input_text, policy).await?;
    let job = job(registered.input_sha256());
    let sent = crate::queue::send_in(conn, &job).await?;
    if let (RegisterOutcome::Replaced { .. }, SendResult::Duplicate, Some(key)) =
        (&registered, &sent, &job.options.singleton_key)
    {
        diesel::sql_query(REPOINT_LIVE_JOB_SQL)
            .bind::<Text, _>(&job.queue)
            .bind::<Text, _>(key)
            .bind::<Jsonb, _>(&job.payload)
            .execute(conn)
            .await
            .map_err(map_diesel_error)?;
    }
    Ok(StartOutcome { registered, sent })
}

/// Points the live job of a singleton key at a new payload. A worker that holds it
/// already reads the old payload: its claim is then refused (`InputMismatch`, the
/// hash is not the stored one) or its commit fenced (the input changed), and the
/// job comes back with this payload. The key's row is locked first (a sender
/// taking the key over waits), and the job is repointed only while it is live:
/// a job whose end is committed is left as it ran. An end not yet committed
/// writes nothing this waits for; a stage's fenced commit meets this on the
/// item's row instead (the caller replaced the item's input before this, the
/// commit share-locks that row): it committed before, and this statement sees
/// the job ended, or it is fenced after (the input changed).
const REPOINT_LIVE_JOB_SQL: &str = "\
WITH holder AS (
    SELECT g.job_id FROM job_keys g
     WHERE g.queue = $1 AND g.singleton_key = $2
       FOR UPDATE
)
UPDATE jobs SET payload = $3, retry_count = 0
 WHERE id IN (SELECT job_id FROM holder WHERE idemstage_key_holder_live(job_id))";
