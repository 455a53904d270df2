//! The four stages, failure injection ([`Chaos`]), the parser and the pricing.

use idemstage::serde_json::json;
use idemstage::{
    async_trait, fenced::FencedTx, pipeline::Pipeline, pipeline::PipelineError, stage::Done,
    stage::OnTimeout, stage::PrepareContext, stage::Signal, stage::Stage, stage::StageError,
    stage::StagePolicy, stage::WaitFor,
};

use crate::llm::LlmClient;
use crate::tables::{ExampleTables, Extraktion};

/// Failure injection for demos and fault tests: with probability `crash_rate` a
/// stage body aborts mid-way, after part of its writes (half by panic, half by a
/// transient error). The fenced transaction must roll those writes back.
#[derive(Clone, Copy, Debug, Default)]
pub struct Chaos {
    /// Probability (0 to 1) that a stage body aborts; 0 never does.
    pub crash_rate: f64,
    /// Up to this many milliseconds (uniformly random) of extra work: once after the
    /// claim (in `prepare`, outside any transaction) and, a quarter of it, inside the
    /// fenced transaction after the first write. Widens the windows in which fault
    /// tests kill, stop or disconnect a worker.
    pub delay_ms: u64,
}

impl Chaos {
    /// Chaos that crashes bodies with probability `crash_rate`, with no delay.
    pub fn crashing(crash_rate: f64) -> Self {
        Self {
            crash_rate,
            ..Self::default()
        }
    }

    async fn delay(&self, max_ms: u64) {
        if max_ms > 0 {
            let ms = rand::random::<u64>() % (max_ms + 1);
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }

    pub(crate) async fn prepare_delay(&self) -> Result<(), StageError> {
        self.delay(self.delay_ms).await;
        Ok(())
    }

    pub(crate) async fn in_tx_delay(&self) {
        self.delay(self.delay_ms / 4).await;
    }

    pub(crate) fn maybe_crash(&self, stage: &str) -> Result<(), StageError> {
        if self.crash_rate <= 0.0 || rand::random::<f64>() >= self.crash_rate {
            return Ok(());
        }
        if rand::random::<bool>() {
            panic!("injected crash in {stage}");
        }
        Err(StageError::Transient(
            format!("injected crash in {stage}").into(),
        ))
    }
}

/// Cents per unit; a unit not listed here makes an item infeasible.
pub const PRICES: &[(&str, i64)] = &[
    ("stk", 150),
    ("m", 320),
    ("m2", 1_200),
    ("kg", 480),
    ("l", 210),
    ("h", 6_500),
    ("psch", 10_000),
];

fn price_of(unit: &str) -> Option<i64> {
    let unit = unit.to_lowercase();
    PRICES.iter().find(|(u, _)| *u == unit).map(|(_, p)| *p)
}

/// The largest quantity a position may have. With the highest price (10_000 cents)
/// a position is then at most 1e13 cents, so the total of any input within the
/// 1 MiB input limit (at most 2^18 priceable lines) stays inside i64 cents.
pub const MAX_QUANTITY: f64 = 1e9;

/// Parses positions, one per non-empty line: `[quantity] [unit] description`, e.g.
/// `10 Stk Schrauben M8`, `2,5 m Kabel NYM`, `Montage vor Ort`.
///
/// A leading number written with digits is the quantity, whatever its size (`1e300`,
/// `1e999` = infinity, `-5`): kept as written so that feasibility can name it
/// (`feasibility_reasons`) rather than the position losing its quantity silently.
/// `inf` or `NaN` are words, not quantities.
pub fn extract_positions(text: &str) -> Vec<Extraktion> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let mut tokens = line.split_whitespace().peekable();
        let quantity = tokens
            .peek()
            .filter(|t| t.bytes().any(|b| b.is_ascii_digit()))
            .and_then(|t| t.replace(',', ".").parse::<f64>().ok());
        if quantity.is_some() {
            tokens.next();
        }
        let unit = match (quantity, tokens.peek()) {
            (Some(_), Some(t)) if t.len() <= 5 && t.chars().all(char::is_alphanumeric) => {
                tokens.next().map(str::to_owned)
            }
            _ => None,
        };
        let description: Vec<&str> = tokens.collect();
        let description = if description.is_empty() {
            line.to_owned()
        } else {
            description.join(" ")
        };
        out.push(Extraktion {
            position_index: out.len() as i32,
            description: description.chars().take(500).collect(),
            quantity,
            unit,
        });
    }
    out
}

struct Named {
    policy: StagePolicy,
    chaos: Chaos,
    /// The extract stage's "LLM" (`None`: the same extraction, in process).
    llm: Option<LlmClient>,
    /// Feasibility: how long an infeasible item waits for a person's review
    /// (`None`: it stops at once).
    review: Option<std::time::Duration>,
}

impl Named {
    fn new(chaos: Chaos) -> Self {
        Self {
            policy: StagePolicy::default(),
            chaos,
            llm: None,
            review: None,
        }
    }
}

/// Stage 1: stores the item's input as a `dateien` row (insert-or-get) and audits it.
pub struct Intake(Named);
/// Stage 2: replaces the item's extracted positions (`extract_positions`).
pub struct Extract(Named);
/// Stage 3: records whether every position can be priced; stops the item if
/// not, or (with [`Feasibility::with_review`]) waits for a person's review
/// first: the signal `review` with `{"approve": true|false, "note": ".."}`.
pub struct Feasibility(Named);

impl Feasibility {
    /// An infeasible item waits up to `timeout` for the signal `review`:
    /// approved, it goes on to calculate; rejected or unanswered, it stops.
    pub fn with_review(mut self, timeout: std::time::Duration) -> Self {
        self.0.review = Some(timeout);
        self
    }
}
/// Stage 4: prices the positions (`price_positions`); an overflow fails permanently.
pub struct Calculate(Named);

macro_rules! named_stage {
    ($t:ident) => {
        impl $t {
            /// The stage with the default policy and `chaos` injected into its body.
            pub fn new(chaos: Chaos) -> Self {
                Self(Named::new(chaos))
            }
            /// The stage with `policy` instead of the default.
            pub fn with_policy(mut self, policy: StagePolicy) -> Self {
                self.0.policy = policy;
                self
            }
        }
    };
}
/// The `policy` of a stage wrapping `Named`.
macro_rules! named_identity {
    () => {
        fn policy(&self) -> StagePolicy {
            self.0.policy.clone()
        }
    };
}

named_stage!(Intake);
named_stage!(Extract);
named_stage!(Feasibility);
named_stage!(Calculate);

#[async_trait]
impl Stage for Intake {
    const NAME: &'static str = "intake";
    // Reads its input inside the fenced transaction (`tx.item_text()`, the
    // bound text), where it writes: one statement there, instead of a read of
    // its own before `prepare`, which has nothing to do with it.
    type Input = ();
    type Prepared = ();
    type Output = ();
    named_identity!();
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        self.0.chaos.prepare_delay().await
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        let item = tx.token().item.to_string();
        let text = tx.item_text().await?;
        let sha = idemstage::ids::input_hash_of(text.as_bytes());
        let s3_key = format!("items/{}/{item}/input.txt", tx.token().tenant);
        // Insert-or-get; its audit entry names the id that exists.
        let datei = tx
            .insert_or_get_datei(&sha, &s3_key, text.len() as i64)
            .await?;
        self.0.chaos.in_tx_delay().await;
        self.0.chaos.maybe_crash("intake")?;
        tx.audit(
            &item,
            "item.intake",
            json!({ "datei_id": datei.id.to_string() }),
        )
        .await?;
        Ok(Done::next(()))
    }
}

impl Extract {
    /// The stage calling the "LLM" at `client` in `prepare` (the seed's model: the
    /// paid call outside the transaction, its answer checkpointed so that a
    /// crash after it does not pay again).
    pub fn with_llm(mut self, client: LlmClient) -> Self {
        self.0.llm = Some(client);
        self
    }
}

#[async_trait]
impl Stage for Extract {
    const NAME: &'static str = "extract";
    type Input = ();
    /// The "LLM"'s answer; `None` without a client: the parse then runs inside
    /// the transaction on the bound text, as cheap as a read.
    type Prepared = Option<Vec<Extraktion>>;
    type Output = ();
    named_identity!();
    /// The extraction, outside any transaction: the "LLM" call, on the input this
    /// run is bound to.
    async fn prepare(
        &self,
        ctx: &PrepareContext<'_, ()>,
    ) -> Result<Option<Vec<Extraktion>>, StageError> {
        self.0.chaos.prepare_delay().await?;
        let Some(llm) = &self.0.llm else {
            return Ok(None);
        };
        let text = ctx.item_text().await?;
        let at = ctx.attempt();
        Ok(Some(llm.extract(&at.tenant, &at.item, &text).await?))
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _: &(),
        answer: &Option<Vec<Extraktion>>,
    ) -> Result<Done<()>, StageError> {
        let item = tx.token().item.to_string();
        let parsed;
        let positions = match answer {
            Some(positions) => positions,
            None => {
                parsed = extract_positions(&tx.item_text().await?);
                &parsed
            }
        };
        tx.replace_extraktionen(positions).await?;
        self.0.chaos.in_tx_delay().await;
        // A crash after the paid call: the next attempt reuses its answer.
        self.0.chaos.maybe_crash("extract")?;
        tx.audit(
            &item,
            "item.extracted",
            json!({ "positions": positions.len() }),
        )
        .await?;
        Ok(Done::next(()))
    }
}

/// A quantity as a reader would write it: `1e300` rather than 301 digits.
fn show_quantity(q: f64) -> String {
    if q.is_finite() && q.abs() < 1e15 {
        q.to_string()
    } else {
        format!("{q:e}")
    }
}

/// Why an item cannot be priced, one reason per problem.
pub fn feasibility_reasons(positions: &[Extraktion]) -> Vec<String> {
    if positions.is_empty() {
        return vec!["no positions found".into()];
    }
    let mut reasons = Vec::new();
    for p in positions {
        match (&p.quantity, &p.unit) {
            (None, _) => reasons.push(format!("position {}: quantity missing", p.position_index)),
            // `contains` is false for NaN and infinities too.
            (Some(q), _) if !(0.0..=MAX_QUANTITY).contains(q) => reasons.push(format!(
                "position {}: quantity {} is out of range (0 to {})",
                p.position_index,
                show_quantity(*q),
                show_quantity(MAX_QUANTITY)
            )),
            (Some(_), None) => reasons.push(format!("position {}: unit missing", p.position_index)),
            (Some(_), Some(u)) if price_of(u).is_none() => {
                reasons.push(format!("position {}: unknown unit {u:?}", p.position_index))
            }
            _ => {}
        }
    }
    reasons
}

#[async_trait]
impl Stage for Feasibility {
    const NAME: &'static str = "feasibility";
    type Input = ();
    type Prepared = ();
    type Output = ();
    named_identity!();
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        self.0.chaos.prepare_delay().await
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        let positions = tx.extraktionen().await?;
        let mut reasons = feasibility_reasons(&positions);
        let mut feasible = reasons.is_empty();
        if let (false, Some(timeout)) = (feasible, self.0.review) {
            // A person decides; until then the stage holds nothing.
            match tx.signal().await? {
                None => {
                    return Err(WaitFor::signal("review", timeout)?
                        .on_timeout(OnTimeout::Resume)
                        .into())
                }
                Some(Signal::Delivered { payload, actor, .. }) => {
                    feasible = payload["approve"].as_bool() == Some(true);
                    let note = payload["note"].as_str().unwrap_or("");
                    let verdict = if feasible { "approved" } else { "rejected" };
                    reasons.push(
                        format!("review: {verdict} by {actor} {note}")
                            .trim()
                            .to_owned(),
                    );
                }
                Some(Signal::TimedOut) => reasons.push("review: none before the deadline".into()),
            }
        }
        tx.put_feasibility(feasible, json!(reasons)).await?;
        self.0.chaos.in_tx_delay().await;
        self.0.chaos.maybe_crash("feasibility")?;
        Ok(if feasible {
            Done::next(())
        } else {
            Done::stop(())
        })
    }
}

#[async_trait]
impl Stage for Calculate {
    const NAME: &'static str = "calculate";
    type Input = ();
    type Prepared = ();
    type Output = ();
    named_identity!();
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        self.0.chaos.prepare_delay().await
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        let item = tx.token().item.to_string();
        let positions = tx.extraktionen().await?;
        // The same input fails the same way on every attempt: permanent.
        let (total, lines) =
            price_positions(&positions).map_err(|e| StageError::Permanent(e.to_string().into()))?;
        tx.put_calculation(total, json!(lines)).await?;
        self.0.chaos.in_tx_delay().await;
        self.0.chaos.maybe_crash("calculate")?;
        tx.audit(&item, "item.calculated", json!({ "total_cents": total }))
            .await?;
        Ok(Done::next(()))
    }
}

/// Why positions cannot be priced by `price_positions`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PriceError {
    /// A position without quantity or unit.
    #[error("position {position} cannot be priced; feasibility should have stopped this")]
    Unpriceable {
        /// The position's `position_index`.
        position: i32,
    },
    /// A unit not in [`PRICES`].
    #[error("no price for unit {unit:?}")]
    UnknownUnit {
        /// The unit as extracted.
        unit: String,
    },
    /// One position's cents do not fit an i64 (or are not finite).
    #[error("position {position}: {quantity} {unit} at {price} cents overflows i64 cents")]
    PositionOverflow {
        /// The position's `position_index`.
        position: i32,
        /// As `show_quantity` writes it.
        quantity: String,
        /// The position's unit.
        unit: String,
        /// The unit's price in cents.
        price: i64,
    },
    /// The running total leaves i64 cents.
    #[error("total overflows i64 cents at position {position}")]
    TotalOverflow {
        /// The position whose cents made the total overflow.
        position: i32,
    },
}

/// The total in cents and one `{position, cents}` line per position. Checked: a
/// position whose cents are not an i64 (or not finite), or a total beyond i64, is an
/// error, never a saturated, wrapped or panicking sum. Quantities may be fractional
/// (`2,5 m`), so each position is priced in f64 and range-checked before it becomes
/// integer cents; feasibility keeps quantities far below these limits.
pub fn price_positions(
    positions: &[Extraktion],
) -> Result<(i64, Vec<idemstage::serde_json::Value>), PriceError> {
    // 2^63 exactly: every finite f64 in [-2^63, 2^63) converts to i64 without loss of range.
    const I64_END: f64 = 9_223_372_036_854_775_808.0;
    let mut total = 0i64;
    let mut lines = Vec::with_capacity(positions.len());
    for p in positions {
        let (Some(q), Some(unit)) = (p.quantity, p.unit.as_deref()) else {
            return Err(PriceError::Unpriceable {
                position: p.position_index,
            });
        };
        let price = price_of(unit).ok_or_else(|| PriceError::UnknownUnit {
            unit: unit.to_owned(),
        })?;
        let cents = (q * price as f64).round();
        if !(-I64_END..I64_END).contains(&cents) {
            return Err(PriceError::PositionOverflow {
                position: p.position_index,
                quantity: show_quantity(q),
                unit: unit.to_owned(),
                price,
            });
        }
        let cents = cents as i64;
        total = total.checked_add(cents).ok_or(PriceError::TotalOverflow {
            position: p.position_index,
        })?;
        lines.push(json!({ "position": p.position_index, "cents": cents }));
    }
    Ok((total, lines))
}

/// The seed's four stages as one pipeline.
pub fn pipeline(chaos: Chaos) -> Pipeline {
    pipeline_with(chaos, StagePolicy::default())
        .expect("the example pipeline with default policies is valid")
}

/// The example pipeline with one policy for every stage (leases, attempts).
pub fn pipeline_with(chaos: Chaos, policy: StagePolicy) -> Result<Pipeline, PipelineError> {
    pipeline_with_llm(chaos, policy, None)
}

/// The example pipeline whose extract stage calls the "LLM" at `llm` (see
/// [`crate::llm`]), or extracts in process (`None`).
pub fn pipeline_with_llm(
    chaos: Chaos,
    policy: StagePolicy,
    llm: Option<LlmClient>,
) -> Result<Pipeline, PipelineError> {
    pipeline_with_options(chaos, policy, llm, None)
}

/// The example pipeline as [`pipeline_with_llm`], whose feasibility stage lets
/// an infeasible item wait up to `review` for a person's review
/// ([`Feasibility::with_review`]; `None`: it stops at once).
pub fn pipeline_with_options(
    chaos: Chaos,
    policy: StagePolicy,
    llm: Option<LlmClient>,
    review: Option<std::time::Duration>,
) -> Result<Pipeline, PipelineError> {
    let mut feasibility = Feasibility::new(chaos).with_policy(policy.clone());
    if let Some(timeout) = review {
        feasibility = feasibility.with_review(timeout);
    }
    let mut extract = Extract::new(chaos).with_policy(policy.clone());
    if let Some(llm) = llm {
        extract = extract.with_llm(llm);
    }
    Pipeline::builder(Intake::new(chaos).with_policy(policy.clone()))
        .then(extract)
        .then(feasibility)
        .then(Calculate::new(chaos).with_policy(policy))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_parsed_per_line() {
        let p =
            extract_positions("10 Stk Schrauben M8\n\n2,5 m Kabel NYM\nMontage vor Ort\n3 Fass Öl");
        assert_eq!(p.len(), 4);
        assert_eq!(
            (p[0].quantity, p[0].unit.as_deref()),
            (Some(10.0), Some("Stk"))
        );
        assert_eq!(p[0].description, "Schrauben M8");
        assert_eq!(
            (p[1].quantity, p[1].unit.as_deref()),
            (Some(2.5), Some("m"))
        );
        assert_eq!((p[2].quantity, p[2].unit.as_deref()), (None, None));
        assert_eq!(p[2].description, "Montage vor Ort");
        assert_eq!(
            feasibility_reasons(&p),
            vec![
                "position 2: quantity missing".to_owned(),
                "position 3: unknown unit \"Fass\"".to_owned()
            ]
        );
        assert!(feasibility_reasons(&p[..2]).is_empty());
    }

    #[test]
    fn quantities_out_of_range_are_kept_and_refused_by_feasibility() {
        let p = extract_positions(
            "1e300 stk Schrauben\n1e999 Stk Muttern\n-5 m Kabel\n1000000001 kg Sand\n\
             1e9 kg Kies\n0 h Pause",
        );
        let q: Vec<_> = p.iter().map(|p| p.quantity).collect();
        assert_eq!(
            q,
            vec![
                Some(1e300),
                Some(f64::INFINITY),
                Some(-5.0),
                Some(1_000_000_001.0),
                Some(1e9),
                Some(0.0)
            ]
        );
        assert_eq!(p[0].description, "Schrauben");
        assert_eq!(
            feasibility_reasons(&p),
            vec![
                "position 0: quantity 1e300 is out of range (0 to 1000000000)".to_owned(),
                "position 1: quantity inf is out of range (0 to 1000000000)".to_owned(),
                "position 2: quantity -5 is out of range (0 to 1000000000)".to_owned(),
                "position 3: quantity 1000000001 is out of range (0 to 1000000000)".to_owned(),
            ]
        );
        // The bound itself is fine, and priced exactly: 1e9 kg × 480 cents.
        assert!(feasibility_reasons(&p[4..]).is_empty());
        assert_eq!(price_positions(&p[4..]).unwrap().0, 480_000_000_000);
    }

    #[test]
    fn words_that_parse_as_floats_are_not_quantities() {
        for line in ["inf stk Schrauben", "NaN stk Schrauben", "Infinity Pool"] {
            let p = extract_positions(line);
            assert_eq!(
                (p[0].quantity, p[0].unit.as_deref()),
                (None, None),
                "{line}"
            );
            assert_eq!(p[0].description, line);
        }
    }

    fn position(i: i32, quantity: f64, unit: &str) -> Extraktion {
        Extraktion {
            position_index: i,
            description: "x".into(),
            quantity: Some(quantity),
            unit: Some(unit.into()),
        }
    }

    #[test]
    fn pricing_is_checked_not_saturated_or_wrapped() {
        let (total, lines) =
            price_positions(&[position(0, 10.0, "Stk"), position(1, 2.5, "m")]).unwrap();
        assert_eq!(total, 2_300);
        assert_eq!(lines[1], json!({ "position": 1, "cents": 800 }));
        for q in [1e300, f64::INFINITY, f64::NAN, 1e17] {
            assert!(
                matches!(
                    price_positions(&[position(0, q, "stk")]),
                    Err(PriceError::PositionOverflow { position: 0, .. })
                ),
                "{q}"
            );
        }
        assert_eq!(
            price_positions(&[position(0, 1e300, "stk")])
                .unwrap_err()
                .to_string(),
            "position 0: 1e300 stk at 150 cents overflows i64 cents"
        );
        // 6e16 × 150 = 9e18 cents fits an i64 (max ≈ 9.22e18); two of them do not.
        assert_eq!(
            price_positions(&[position(0, 6e16, "stk")]).unwrap().0,
            9_000_000_000_000_000_000
        );
        assert_eq!(
            price_positions(&[position(0, 6e16, "stk"), position(1, 6e16, "stk")]),
            Err(PriceError::TotalOverflow { position: 1 })
        );
        assert_eq!(
            price_positions(&[position(0, 6e16, "stk"), position(1, -6e16, "stk")])
                .unwrap()
                .0,
            0
        );
    }
}
