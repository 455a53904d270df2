//! The example pipeline's own tables (`dateien`, `anfrage_extraktionen`,
//! `feasibility_results`, `calculation_results`), written the way a team writes
//! its tables: an extension trait on [`FencedTx`] over the tenant-scoped
//! connection and the generic helpers. Nothing in the core calls this.

use diesel::prelude::*;
use diesel::upsert::excluded;
use idemstage::diesel_async::{self, AsyncPgConnection, RunQueryDsl};
use idemstage::serde_json;
use idemstage::{
    async_trait, db::map_diesel_error, db::RepoError, fenced::insert_or_get, fenced::FencedTx,
    fenced::InsertOrGet, fenced::Replaced, ids::RowId, ids::TenantId, runs::ClaimToken,
};

use crate::schema::{anfrage_extraktionen, calculation_results, dateien, feasibility_results};

/// One extracted position (a child row of an item). Serialized as the LLM
/// service sends it (the quantity as a string, so that any f64 survives).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(
    into = "crate::llm::WirePosition",
    try_from = "crate::llm::WirePosition"
)]
pub struct Extraktion {
    /// The position's number in the item, from 0.
    pub position_index: i32,
    /// What is asked for (at most 500 characters).
    pub description: String,
    /// The quantity, if the line starts with one (not range-checked here).
    pub quantity: Option<f64>,
    /// The unit after the quantity, if any.
    pub unit: Option<String>,
}

/// The id of a `dateien` row and whether this call created it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DateiRef {
    /// The row's id (the existing row's, if it was there).
    pub id: RowId,
    /// Whether this call inserted it.
    pub inserted: bool,
}

#[derive(Insertable)]
#[diesel(table_name = anfrage_extraktionen)]
struct NewExtraktion<'a> {
    id: String,
    tenant_id: &'a str,
    item_id: String,
    position_index: i32,
    description: &'a str,
    quantity: Option<f64>,
    unit: Option<&'a str>,
    run_id: String,
    attempt: i32,
}

/// The columns `NewExtraktion` inserts, each a bind parameter: what decides how
/// many rows one INSERT may carry (`FencedTx::replace_children_chunked`).
const EXTRAKTION_COLUMNS: usize = 9;

fn extraktion_rows<'a>(token: &'a ClaimToken, rows: &'a [Extraktion]) -> Vec<NewExtraktion<'a>> {
    rows.iter()
        .map(|r| NewExtraktion {
            id: RowId::new().to_string(),
            tenant_id: token.tenant.as_str(),
            item_id: token.item.to_string(),
            position_index: r.position_index,
            description: &r.description,
            quantity: r.quantity,
            unit: r.unit.as_deref(),
            run_id: token.run_id.to_string(),
            attempt: token.attempt,
        })
        .collect()
}

/// Insert-or-get of a `dateien` row by `(tenant_id, sha256, s3_key)` on any
/// connection.
pub async fn insert_or_get_datei(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item_id: &str,
    sha256: &str,
    s3_key: &str,
    size_bytes: i64,
) -> Result<DateiRef, RepoError> {
    let found = insert_or_get(
        conn,
        &format!("dateien ({tenant}, {sha256}, {s3_key})"),
        || insert_datei(tenant, item_id, sha256, s3_key, size_bytes),
        || select_datei(tenant, sha256, s3_key),
    )
    .await?;
    datei_ref(found)
}

fn insert_datei<'a>(
    tenant: &'a TenantId,
    item_id: &'a str,
    sha256: &'a str,
    s3_key: &'a str,
    size_bytes: i64,
) -> impl diesel_async::methods::LoadQuery<'a, AsyncPgConnection, String> + Send + 'a {
    use dateien::dsl as d;
    diesel::insert_into(d::dateien)
        .values((
            d::id.eq(RowId::new().to_string()),
            d::tenant_id.eq(tenant.as_str()),
            d::item_id.eq(item_id),
            d::sha256.eq(sha256),
            d::s3_key.eq(s3_key),
            d::size_bytes.eq(size_bytes),
        ))
        .on_conflict((d::tenant_id, d::sha256, d::s3_key))
        .do_nothing()
        .returning(d::id)
}

fn select_datei<'a>(
    tenant: &'a TenantId,
    sha256: &'a str,
    s3_key: &'a str,
) -> impl diesel_async::methods::LoadQuery<'a, AsyncPgConnection, String> + Send + 'a {
    use dateien::dsl as d;
    d::dateien
        .filter(d::tenant_id.eq(tenant.as_str()))
        .filter(d::sha256.eq(sha256))
        .filter(d::s3_key.eq(s3_key))
        .select(d::id)
        .limit(1)
}

fn datei_ref(found: InsertOrGet<String>) -> Result<DateiRef, RepoError> {
    Ok(DateiRef {
        id: RowId::parse(&found.id)?,
        inserted: found.inserted,
    })
}

/// The example's writes, on the fenced transaction of one of its stages.
#[async_trait]
pub trait ExampleTables {
    /// DELETE-before-INSERT of the item's `anfrage_extraktionen`.
    async fn replace_extraktionen(&mut self, rows: &[Extraktion]) -> Result<Replaced, RepoError>;

    /// The per-row upsert variant: same end state as `replace_extraktionen`.
    async fn upsert_extraktionen(&mut self, rows: &[Extraktion]) -> Result<Replaced, RepoError>;

    /// Insert-or-get of the item's input file, with an audit entry naming the id
    /// that exists (`datei.created` or `datei.reused`).
    async fn insert_or_get_datei(
        &mut self,
        sha256: &str,
        s3_key: &str,
        size_bytes: i64,
    ) -> Result<DateiRef, RepoError>;

    /// Upserts the item's `feasibility_results` row.
    async fn put_feasibility(
        &mut self,
        feasible: bool,
        reasons: serde_json::Value,
    ) -> Result<(), RepoError>;

    /// Upserts the item's `calculation_results` row.
    async fn put_calculation(
        &mut self,
        total_cents: i64,
        lines: serde_json::Value,
    ) -> Result<(), RepoError>;

    /// The item's extracted positions, in order.
    async fn extraktionen(&mut self) -> Result<Vec<Extraktion>, RepoError>;
}

#[async_trait]
impl ExampleTables for FencedTx<'_> {
    async fn replace_extraktionen(&mut self, rows: &[Extraktion]) -> Result<Replaced, RepoError> {
        use anfrage_extraktionen::dsl as ae;
        let token = self.token().clone();
        let delete = diesel::delete(
            ae::anfrage_extraktionen
                .filter(ae::tenant_id.eq(token.tenant.as_str()))
                .filter(ae::item_id.eq(token.item.to_string())),
        );
        // In chunks: one INSERT of an input's every line broke the protocol's
        // 65,535 bind parameters from 7,282 lines on (issue 29).
        self.replace_children_chunked(delete, rows, EXTRAKTION_COLUMNS, |chunk| {
            diesel::insert_into(ae::anfrage_extraktionen).values(extraktion_rows(&token, chunk))
        })
        .await
    }

    async fn upsert_extraktionen(&mut self, rows: &[Extraktion]) -> Result<Replaced, RepoError> {
        use anfrage_extraktionen::dsl as ae;
        let token = self.token().clone();
        // One array parameter (`= ANY($n)`), whatever the number of positions.
        let keep: Vec<i32> = rows.iter().map(|r| r.position_index).collect();
        let delete_rest = diesel::delete(
            ae::anfrage_extraktionen
                .filter(ae::tenant_id.eq(token.tenant.as_str()))
                .filter(ae::item_id.eq(token.item.to_string()))
                .filter(diesel::dsl::not(ae::position_index.eq_any(keep))),
        );
        // No rows: no upsert statement, only the delete.
        self.upsert_children_chunked(
            rows,
            EXTRAKTION_COLUMNS,
            |chunk| {
                diesel::insert_into(ae::anfrage_extraktionen)
                    .values(extraktion_rows(&token, chunk))
                    .on_conflict((ae::tenant_id, ae::item_id, ae::position_index))
                    .do_update()
                    .set((
                        ae::description.eq(excluded(ae::description)),
                        ae::quantity.eq(excluded(ae::quantity)),
                        ae::unit.eq(excluded(ae::unit)),
                        ae::run_id.eq(excluded(ae::run_id)),
                        ae::attempt.eq(excluded(ae::attempt)),
                    ))
            },
            delete_rest,
        )
        .await
    }

    async fn insert_or_get_datei(
        &mut self,
        sha256: &str,
        s3_key: &str,
        size_bytes: i64,
    ) -> Result<DateiRef, RepoError> {
        let token = self.token().clone();
        let item_id = token.item.to_string();
        let found = self
            .insert_or_get_audited(
                &format!("dateien ({}, {sha256}, {s3_key})", token.tenant),
                ("datei.created", "datei.reused"),
                serde_json::json!({ "sha256": sha256, "s3_key": s3_key }),
                || insert_datei(&token.tenant, &item_id, sha256, s3_key, size_bytes),
                || select_datei(&token.tenant, sha256, s3_key),
            )
            .await?;
        datei_ref(found)
    }

    async fn put_feasibility(
        &mut self,
        feasible: bool,
        reasons: serde_json::Value,
    ) -> Result<(), RepoError> {
        use feasibility_results::dsl as f;
        let token = self.token().clone();
        diesel::insert_into(f::feasibility_results)
            .values((
                f::tenant_id.eq(token.tenant.as_str()),
                f::item_id.eq(token.item.to_string()),
                f::feasible.eq(feasible),
                f::reasons.eq(&reasons),
                f::run_id.eq(token.run_id.to_string()),
                f::attempt.eq(token.attempt),
            ))
            .on_conflict((f::tenant_id, f::item_id))
            .do_update()
            .set((
                f::feasible.eq(feasible),
                f::reasons.eq(&reasons),
                f::run_id.eq(token.run_id.to_string()),
                f::attempt.eq(token.attempt),
            ))
            .execute(self.conn())
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
        let token = self.token().clone();
        diesel::insert_into(c::calculation_results)
            .values((
                c::tenant_id.eq(token.tenant.as_str()),
                c::item_id.eq(token.item.to_string()),
                c::total_cents.eq(total_cents),
                c::lines.eq(&lines),
                c::run_id.eq(token.run_id.to_string()),
                c::attempt.eq(token.attempt),
            ))
            .on_conflict((c::tenant_id, c::item_id))
            .do_update()
            .set((
                c::total_cents.eq(total_cents),
                c::lines.eq(&lines),
                c::run_id.eq(token.run_id.to_string()),
                c::attempt.eq(token.attempt),
            ))
            .execute(self.conn())
            .await
            .map_err(map_diesel_error)?;
        Ok(())
    }

    async fn extraktionen(&mut self) -> Result<Vec<Extraktion>, RepoError> {
        use anfrage_extraktionen::dsl as ae;
        let token = self.token().clone();
        let rows: Vec<(i32, String, Option<f64>, Option<String>)> = ae::anfrage_extraktionen
            .filter(ae::tenant_id.eq(token.tenant.as_str()))
            .filter(ae::item_id.eq(token.item.to_string()))
            .order(ae::position_index)
            .select((ae::position_index, ae::description, ae::quantity, ae::unit))
            .load(self.conn())
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
