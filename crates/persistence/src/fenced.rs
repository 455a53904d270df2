//! The stage's writes inside the fenced completion transaction, and the seed's two
//! write patterns (replace-children, insert-or-get) as reusable helpers.

use async_trait::async_trait;
use diesel::prelude::*;
use diesel::upsert::excluded;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    ClaimToken, DateiRef, Extraktion, FencedTx, JobCompleteOutcome, JobId, JobToSend, RepoError,
    RowId, SendResult, TenantId,
};

use crate::error::map_diesel_error;
use crate::schema::{
    anfrage_extraktionen, anfragen, audit_log, calculation_results, dateien, feasibility_results,
};

/// How often insert-or-get retries when the row it conflicted with is gone again.
pub const INSERT_OR_GET_TRIES: u32 = 5;

/// The persistence side of `FencedTx`: a connection inside the open transaction whose
/// first statement checked the token.
pub struct PgFencedTx<'c> {
    conn: &'c mut AsyncPgConnection,
    token: ClaimToken,
}

impl<'c> PgFencedTx<'c> {
    pub(crate) fn new(conn: &'c mut AsyncPgConnection, token: ClaimToken) -> Self {
        Self { conn, token }
    }

    pub fn conn(&mut self) -> &mut AsyncPgConnection {
        self.conn
    }
}

#[derive(Insertable)]
#[diesel(table_name = anfrage_extraktionen)]
struct NewExtraktion<'a> {
    id: String,
    tenant_id: &'a str,
    anfrage_id: String,
    position_index: i32,
    description: &'a str,
    quantity: Option<f64>,
    unit: Option<&'a str>,
    run_id: String,
    attempt: i32,
}

fn extraktion_rows<'a>(token: &'a ClaimToken, rows: &'a [Extraktion]) -> Vec<NewExtraktion<'a>> {
    rows.iter()
        .map(|r| NewExtraktion {
            id: RowId::new().to_string(),
            tenant_id: token.tenant.as_str(),
            anfrage_id: token.anfrage.to_string(),
            position_index: r.position_index,
            description: &r.description,
            quantity: r.quantity,
            unit: r.unit.as_deref(),
            run_id: token.run_id.to_string(),
            attempt: token.attempt,
        })
        .collect()
}

/// DELETE-before-INSERT of an anfrage's children. Only safe inside the fenced
/// transaction: the fence's row lock serializes replacers of the same run.
pub async fn replace_extraktionen(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
    rows: &[Extraktion],
) -> Result<usize, RepoError> {
    use anfrage_extraktionen::dsl as ae;
    diesel::delete(
        ae::anfrage_extraktionen
            .filter(ae::tenant_id.eq(token.tenant.as_str()))
            .filter(ae::anfrage_id.eq(token.anfrage.to_string())),
    )
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    if rows.is_empty() {
        return Ok(0);
    }
    diesel::insert_into(ae::anfrage_extraktionen)
        .values(extraktion_rows(token, rows))
        .execute(conn)
        .await
        .map_err(map_diesel_error)
}

/// The per-row variant for large child sets: upsert every position, then delete the
/// positions past the new set. Ends in the same state as `replace_extraktionen`.
pub async fn upsert_extraktionen(
    conn: &mut AsyncPgConnection,
    token: &ClaimToken,
    rows: &[Extraktion],
) -> Result<usize, RepoError> {
    use anfrage_extraktionen::dsl as ae;
    let mut written = 0;
    if !rows.is_empty() {
        written = diesel::insert_into(ae::anfrage_extraktionen)
            .values(extraktion_rows(token, rows))
            .on_conflict((ae::tenant_id, ae::anfrage_id, ae::position_index))
            .do_update()
            .set((
                ae::description.eq(excluded(ae::description)),
                ae::quantity.eq(excluded(ae::quantity)),
                ae::unit.eq(excluded(ae::unit)),
                ae::run_id.eq(excluded(ae::run_id)),
                ae::attempt.eq(excluded(ae::attempt)),
            ))
            .execute(conn)
            .await
            .map_err(map_diesel_error)?;
    }
    let keep: Vec<i32> = rows.iter().map(|r| r.position_index).collect();
    diesel::delete(
        ae::anfrage_extraktionen
            .filter(ae::tenant_id.eq(token.tenant.as_str()))
            .filter(ae::anfrage_id.eq(token.anfrage.to_string()))
            .filter(diesel::dsl::not(ae::position_index.eq_any(keep))),
    )
    .execute(conn)
    .await
    .map_err(map_diesel_error)?;
    Ok(written)
}

/// Insert-or-get of a file: `ON CONFLICT DO NOTHING RETURNING id`, and when nothing
/// comes back, SELECT the existing id. If that row was deleted in between, try again
/// a bounded number of times, then fail with `InsertOrGetExhausted`.
pub async fn insert_or_get_datei(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    anfrage_id: &str,
    sha256: &str,
    s3_key: &str,
    size_bytes: i64,
) -> Result<DateiRef, RepoError> {
    use dateien::dsl as d;
    for _ in 0..INSERT_OR_GET_TRIES {
        let id = RowId::new();
        let inserted: Option<String> = diesel::insert_into(d::dateien)
            .values((
                d::id.eq(id.to_string()),
                d::tenant_id.eq(tenant.as_str()),
                d::anfrage_id.eq(anfrage_id),
                d::sha256.eq(sha256),
                d::s3_key.eq(s3_key),
                d::size_bytes.eq(size_bytes),
            ))
            .on_conflict((d::tenant_id, d::sha256, d::s3_key))
            .do_nothing()
            .returning(d::id)
            .get_result(conn)
            .await
            .optional()
            .map_err(map_diesel_error)?;
        if inserted.is_some() {
            return Ok(DateiRef { id, inserted: true });
        }
        let existing: Option<String> = d::dateien
            .filter(d::tenant_id.eq(tenant.as_str()))
            .filter(d::sha256.eq(sha256))
            .filter(d::s3_key.eq(s3_key))
            .select(d::id)
            .first(conn)
            .await
            .optional()
            .map_err(map_diesel_error)?;
        if let Some(existing) = existing {
            return Ok(DateiRef {
                id: RowId::parse(&existing)?,
                inserted: false,
            });
        }
    }
    Err(RepoError::InsertOrGetExhausted {
        what: format!("dateien ({tenant}, {sha256}, {s3_key})"),
        tries: INSERT_OR_GET_TRIES,
    })
}

/// Appends an audit entry.
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

#[async_trait]
impl FencedTx for PgFencedTx<'_> {
    fn token(&self) -> &ClaimToken {
        &self.token
    }

    async fn replace_extraktionen(&mut self, rows: &[Extraktion]) -> Result<usize, RepoError> {
        replace_extraktionen(self.conn, &self.token, rows).await
    }

    async fn upsert_extraktionen(&mut self, rows: &[Extraktion]) -> Result<usize, RepoError> {
        upsert_extraktionen(self.conn, &self.token, rows).await
    }

    async fn insert_or_get_datei(
        &mut self,
        sha256: &str,
        s3_key: &str,
        size_bytes: i64,
    ) -> Result<DateiRef, RepoError> {
        let datei = insert_or_get_datei(
            self.conn,
            &self.token.tenant,
            &self.token.anfrage.to_string(),
            sha256,
            s3_key,
            size_bytes,
        )
        .await?;
        let action = if datei.inserted {
            "datei.created"
        } else {
            "datei.reused"
        };
        audit(
            self.conn,
            &self.token.tenant,
            &datei.id.to_string(),
            action,
            Some(&self.token),
            serde_json::json!({ "sha256": sha256, "s3_key": s3_key }),
        )
        .await?;
        Ok(datei)
    }

    async fn audit(
        &mut self,
        entity_id: &str,
        action: &str,
        details: serde_json::Value,
    ) -> Result<RowId, RepoError> {
        audit(
            self.conn,
            &self.token.tenant,
            entity_id,
            action,
            Some(&self.token),
            details,
        )
        .await
    }

    async fn put_feasibility(
        &mut self,
        feasible: bool,
        reasons: serde_json::Value,
    ) -> Result<(), RepoError> {
        use feasibility_results::dsl as f;
        let values = (
            f::tenant_id.eq(self.token.tenant.as_str()),
            f::anfrage_id.eq(self.token.anfrage.to_string()),
            f::feasible.eq(feasible),
            f::reasons.eq(&reasons),
            f::run_id.eq(self.token.run_id.to_string()),
            f::attempt.eq(self.token.attempt),
        );
        diesel::insert_into(f::feasibility_results)
            .values(values.clone())
            .on_conflict((f::tenant_id, f::anfrage_id))
            .do_update()
            .set((
                f::feasible.eq(feasible),
                f::reasons.eq(&reasons),
                f::run_id.eq(self.token.run_id.to_string()),
                f::attempt.eq(self.token.attempt),
            ))
            .execute(self.conn)
            .await
            .map_err(map_diesel_error)?;
        Ok(())
    }

    async fn put_calculation(
        &mut self,
        total_cents: i64,
        lines: serde_json::Value,
    ) -> Result<(), RepoError> {
        use calculation_results::dsl as c;
        diesel::insert_into(c::calculation_results)
            .values((
                c::tenant_id.eq(self.token.tenant.as_str()),
                c::anfrage_id.eq(self.token.anfrage.to_string()),
                c::total_cents.eq(total_cents),
                c::lines.eq(&lines),
                c::run_id.eq(self.token.run_id.to_string()),
                c::attempt.eq(self.token.attempt),
            ))
            .on_conflict((c::tenant_id, c::anfrage_id))
            .do_update()
            .set((
                c::total_cents.eq(total_cents),
                c::lines.eq(&lines),
                c::run_id.eq(self.token.run_id.to_string()),
                c::attempt.eq(self.token.attempt),
            ))
            .execute(self.conn)
            .await
            .map_err(map_diesel_error)?;
        Ok(())
    }

    async fn send_job(&mut self, job: &JobToSend) -> Result<SendResult, RepoError> {
        crate::queue::send_in(self.conn, job).await
    }

    async fn complete_job(
        &mut self,
        job: JobId,
        attempt: i32,
    ) -> Result<JobCompleteOutcome, RepoError> {
        crate::queue::complete(self.conn, job, attempt, None).await
    }

    async fn anfrage_text(&mut self) -> Result<String, RepoError> {
        use anfragen::dsl as a;
        a::anfragen
            .filter(a::tenant_id.eq(self.token.tenant.as_str()))
            .filter(a::id.eq(self.token.anfrage.to_string()))
            .select(a::input_text)
            .first(self.conn)
            .await
            .optional()
            .map_err(map_diesel_error)?
            .ok_or_else(|| RepoError::AnfrageNotFound {
                tenant: self.token.tenant.to_string(),
                anfrage: self.token.anfrage.to_string(),
            })
            // The limit holds for input that did not come through `register_anfrage`
            // (written by hand or by another tool): a clear, permanent error.
            .and_then(|text: String| {
                crate::anfragen::validate_input(&text)?;
                Ok(text)
            })
    }

    async fn extraktionen(&mut self) -> Result<Vec<Extraktion>, RepoError> {
        use anfrage_extraktionen::dsl as ae;
        let rows: Vec<(i32, String, Option<f64>, Option<String>)> = ae::anfrage_extraktionen
            .filter(ae::tenant_id.eq(self.token.tenant.as_str()))
            .filter(ae::anfrage_id.eq(self.token.anfrage.to_string()))
            .order(ae::position_index)
            .select((ae::position_index, ae::description, ae::quantity, ae::unit))
            .load(self.conn)
            .await
            .map_err(map_diesel_error)?;
        Ok(rows
            .into_iter()
            .map(|(position_index, description, quantity, unit)| Extraktion {
                position_index,
                description,
                quantity,
                unit,
            })
            .collect())
    }
}
