//! The checker's test of results against the input their run is bound to: each
//! current result of extract, feasibility and calculate is computed again from the
//! text of its run's `input_hash` (the item's stored input, or the replaced one
//! the core keeps) and compared with what the database holds.

use std::collections::HashMap;

use diesel::prelude::*;
use diesel::sql_types::{Bool, Double, Integer, Nullable, Text};
use idemstage::diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::{db::map_diesel_error, db::RepoError};

use crate::stages::{extract_positions, feasibility_reasons, price_positions};
use crate::tables::Extraktion;

/// Every current success of a stage after intake, with the text its run is bound
/// to (NULL if neither the item nor its kept inputs hold that hash) and the
/// stage's result (feasibility's flag, calculate's total).
const BOUND_SQL: &str = "
SELECT r.id AS run_id, r.stage,
       coalesce(a.input_text, i.input_text) AS input_text,
       f.feasible, c.total_cents
  FROM stage_runs r
  LEFT JOIN items a ON a.tenant_id = r.tenant_id AND a.id = r.item_id
                      AND a.input_sha256 = r.input_hash
  LEFT JOIN item_inputs i ON i.tenant_id = r.tenant_id AND i.item_id = r.item_id
                            AND i.input_sha256 = r.input_hash
  LEFT JOIN feasibility_results f ON r.stage = 'feasibility' AND f.tenant_id = r.tenant_id
                                 AND f.item_id = r.item_id
  LEFT JOIN calculation_results c ON r.stage = 'calculate' AND c.tenant_id = r.tenant_id
                                 AND c.item_id = r.item_id
 WHERE r.status = 'success' AND r.stage IN ('extract', 'feasibility', 'calculate')";

/// The positions of every current extract success, in order.
const POSITIONS_SQL: &str = "
SELECT x.run_id, x.position_index, x.description, x.quantity, x.unit
  FROM anfrage_extraktionen x
  JOIN stage_runs r ON r.id = x.run_id AND r.success_attempt = x.attempt
 WHERE r.status = 'success'
 ORDER BY x.run_id, x.position_index";

#[derive(QueryableByName)]
struct BoundRow {
    #[diesel(sql_type = Text)]
    run_id: String,
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Nullable<Text>)]
    input_text: Option<String>,
    #[diesel(sql_type = Nullable<Bool>)]
    feasible: Option<bool>,
    #[diesel(sql_type = Nullable<diesel::sql_types::BigInt>)]
    total_cents: Option<i64>,
}

#[derive(QueryableByName)]
struct PositionRow {
    #[diesel(sql_type = Text)]
    run_id: String,
    #[diesel(sql_type = Integer)]
    position_index: i32,
    #[diesel(sql_type = Text)]
    description: String,
    #[diesel(sql_type = Nullable<Double>)]
    quantity: Option<f64>,
    #[diesel(sql_type = Nullable<Text>)]
    unit: Option<String>,
}

/// Two quantities are the same if both are missing, or equal (NaN equal to NaN:
/// the parser keeps `NaN` written as a number as it is).
fn same_quantity(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a == b || (a.is_nan() && b.is_nan()),
        _ => false,
    }
}

fn same_positions(stored: &[Extraktion], computed: &[Extraktion]) -> bool {
    stored.len() == computed.len()
        && stored.iter().zip(computed).all(|(s, c)| {
            s.position_index == c.position_index
                && s.description == c.description
                && s.unit == c.unit
                && same_quantity(s.quantity, c.quantity)
        })
}

/// Current results that differ from what their bound input computes (or whose
/// bound input is not stored): must be 0.
pub(super) async fn unbound_results(conn: &mut AsyncPgConnection) -> Result<i64, RepoError> {
    let runs: Vec<BoundRow> = diesel::sql_query(BOUND_SQL)
        .load(conn)
        .await
        .map_err(map_diesel_error)?;
    let rows: Vec<PositionRow> = diesel::sql_query(POSITIONS_SQL)
        .load(conn)
        .await
        .map_err(map_diesel_error)?;
    let mut stored: HashMap<String, Vec<Extraktion>> = HashMap::new();
    for r in rows {
        stored.entry(r.run_id).or_default().push(Extraktion {
            position_index: r.position_index,
            description: r.description,
            quantity: r.quantity,
            unit: r.unit,
        });
    }
    let mut wrong = 0;
    for run in runs {
        let Some(text) = run.input_text else {
            wrong += 1;
            continue;
        };
        let positions = extract_positions(&text);
        let sound = match run.stage.as_str() {
            "extract" => same_positions(
                stored.get(&run.run_id).map_or(&[][..], Vec::as_slice),
                &positions,
            ),
            "feasibility" => run.feasible == Some(feasibility_reasons(&positions).is_empty()),
            _ => run.total_cents == price_positions(&positions).ok().map(|(total, _)| total),
        };
        if !sound {
            wrong += 1;
        }
    }
    Ok(wrong)
}
