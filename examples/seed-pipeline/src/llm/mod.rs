//! A small local "LLM" service and its client, for the seed's extract stage.
//!
//! The seed's extract stage is meant to be an external, paid call: a request to a
//! language model made in the stage's `prepare` phase (outside the fenced
//! transaction), whose answer is checkpointed so that a worker that crashes after
//! the call reuses it instead of paying for it again. This module is that service,
//! run in-process on 127.0.0.1 so that demos and tests stay offline and
//! deterministic:
//!
//! - [`LlmServer`] answers `POST /v1/extract` with exactly the positions
//!   [`extract_positions`](crate::extract_positions) finds in the text (the same
//!   function, so the service and the in-transaction parse never disagree), after
//!   an optional latency, with optional faults ([`LlmConfig`]: a 429 every Nth
//!   request, a share of 500s, drawn from a seeded random generator). It counts
//!   the calls it answered with 200 ("external calls paid", [`LlmServer::calls`])
//!   and every request ([`LlmServer::requests`]).
//! - [`LlmClient`] calls it and maps the answer onto
//!   [`StageError`](idemstage::stage::StageError) the way a stage needs it: 429 →
//!   `RateLimited`, 5xx, 408, connection errors and timeouts → `Transient`, other
//!   4xx → `Permanent`.
//!
//! ## The wire format
//!
//! Request, `POST /v1/extract` with a JSON body:
//!
//! ```json
//! { "tenant": "acme", "item": "01JABCDEFGHJKMNPQRSTVWXYZ0", "text": "10 Stk Schrauben M8" }
//! ```
//!
//! `tenant` must be a valid [`TenantId`](idemstage::ids::TenantId), `item` a valid
//! [`ItemId`](idemstage::ids::ItemId) and `text` at most [`MAX_TEXT_BYTES`]; the
//! positions depend on `text` alone. Answers:
//!
//! - `200` with `{ "positions": [ { "position_index": 0, "description":
//!   "Schrauben M8", "quantity": "10", "unit": "Stk" } ] }`. `quantity` (or `null`)
//!   is a *string*, Rust's shortest round-trip form of the `f64` (`"2.5"`,
//!   `"1e300"`, `"inf"`): a JSON number cannot carry the infinity that `1e999`
//!   parses to, and a decimal read back by a JSON parser need not be the same
//!   `f64`; the string always is.
//! - `422` with `{ "error": "..." }` for a body that is not such a request (bad
//!   JSON, a missing field, an invalid id, a text over the limit); `413` for a
//!   body over 8 MiB.
//! - `429` with `{ "error": ... }` and two headers saying how long to wait:
//!   `Retry-After` in whole seconds (rounded up, as HTTP has it) and
//!   `Retry-After-Ms` in milliseconds (exact; the convention of hosted LLM APIs).
//!   The client prefers the latter.
//! - `500` with `{ "error": ... }` for an injected failure.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use idemstage_example::llm::{LlmClient, LlmConfig, LlmServer};
//!
//! let server = LlmServer::start(
//!     LlmConfig::default()
//!         .with_latency(Duration::from_millis(50))
//!         .with_rate_limited_every(10),
//! )?;
//! let client = LlmClient::new(server.url());
//! let tenant = idemstage::ids::TenantId::parse("acme")?;
//! let item = idemstage::ids::ItemId::new();
//! let positions = client.extract(&tenant, &item, "10 Stk Schrauben M8").await?;
//! assert_eq!(positions, idemstage_example::extract_positions("10 Stk Schrauben M8"));
//! println!("external calls paid: {}", server.calls());
//! server.shutdown().await?;
//! # Ok(())
//! # }
//! ```

use serde::{Deserialize, Serialize};

use crate::tables::Extraktion;

mod client;
mod server;

pub use client::{LlmClient, DEFAULT_TIMEOUT};
pub use server::{LlmConfig, LlmCounters, LlmServer};

/// The longest `text` the service takes, in bytes: the core's limit on an
/// item's input (1 MiB). A longer one is answered 422.
pub const MAX_TEXT_BYTES: usize = 1024 * 1024;

/// The path of the extraction endpoint.
const EXTRACT_PATH: &str = "/v1/extract";

/// The header carrying the wait of a 429 in milliseconds (besides `Retry-After`
/// in whole seconds).
const RETRY_AFTER_MS: &str = "retry-after-ms";

/// The body of `POST /v1/extract`.
#[derive(Debug, Serialize, Deserialize)]
struct ExtractRequest<'a> {
    #[serde(borrow)]
    tenant: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    item: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    text: std::borrow::Cow<'a, str>,
}

/// The body of a 200.
#[derive(Debug, Serialize, Deserialize)]
struct ExtractResponse {
    positions: Vec<WirePosition>,
}

/// One position on the wire: an [`Extraktion`] with its quantity as a string
/// (also its form in a checkpoint: JSON numbers cannot hold an infinity).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WirePosition {
    position_index: i32,
    description: String,
    quantity: Option<String>,
    unit: Option<String>,
}

/// The body of every answer but a 200.
#[derive(Debug, Serialize, Deserialize)]
struct ErrorBody {
    error: String,
}

impl From<&Extraktion> for WirePosition {
    fn from(p: &Extraktion) -> Self {
        Self {
            position_index: p.position_index,
            description: p.description.clone(),
            // Debug is the shortest form that parses back to the same f64, and
            // writes 1e300 rather than 301 digits.
            quantity: p.quantity.map(|q| format!("{q:?}")),
            unit: p.unit.clone(),
        }
    }
}

impl From<Extraktion> for WirePosition {
    fn from(p: Extraktion) -> Self {
        Self::from(&p)
    }
}

impl TryFrom<WirePosition> for Extraktion {
    type Error = String;

    fn try_from(p: WirePosition) -> Result<Self, String> {
        let quantity = p
            .quantity
            .map(|q| {
                q.parse::<f64>().map_err(|_| {
                    format!("position {}: quantity {q:?} is no number", p.position_index)
                })
            })
            .transpose()?;
        Ok(Self {
            position_index: p.position_index,
            description: p.description,
            quantity,
            unit: p.unit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_survive_the_wire_exactly() {
        for q in [
            0.0,
            -0.0,
            2.5,
            0.1 + 0.2,
            1.2345678901234567e-5,
            1e300,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MAX,
            f64::MIN_POSITIVE,
            5e-324,
        ] {
            let p = Extraktion {
                position_index: 0,
                description: "x".into(),
                quantity: Some(q),
                unit: None,
            };
            let json = serde_json_roundtrip(&WirePosition::from(&p));
            let back = Extraktion::try_from(json).unwrap();
            let got = back.quantity.unwrap();
            assert_eq!(got.to_bits(), q.to_bits(), "{q:?}");
        }
        let nan = Extraktion {
            position_index: 0,
            description: "x".into(),
            quantity: Some(f64::NAN),
            unit: None,
        };
        let back = Extraktion::try_from(serde_json_roundtrip(&WirePosition::from(&nan))).unwrap();
        assert!(back.quantity.unwrap().is_nan());
    }

    #[test]
    fn a_quantity_that_is_no_number_is_refused() {
        let p = WirePosition {
            position_index: 3,
            description: "x".into(),
            quantity: Some("zwei".into()),
            unit: None,
        };
        assert_eq!(
            Extraktion::try_from(p).unwrap_err(),
            "position 3: quantity \"zwei\" is no number"
        );
    }

    fn serde_json_roundtrip(p: &WirePosition) -> WirePosition {
        let json = idemstage::serde_json::to_string(p).unwrap();
        idemstage::serde_json::from_str(&json).unwrap()
    }
}
