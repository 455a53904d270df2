//! The seed's example pipeline: intake → extract → feasibility → calculate.
//! Deterministic and offline: the "LLM" is a line parser over the anfrage's text.

use std::sync::Arc;

use async_trait::async_trait;
use idemstage_domain::{Extraktion, FencedTx, StageError, StageName, StagePolicy};
use serde_json::json;

use crate::{Pipeline, Stage, StageFlow, StageJob};

/// Failure injection for demos and fault tests: with probability `crash_rate` a
/// stage body aborts mid-way, after part of its writes (half by panic, half by a
/// transient error). The fenced transaction must roll those writes back.
#[derive(Clone, Copy, Debug, Default)]
pub struct Chaos {
    pub crash_rate: f64,
    /// Up to this many milliseconds (uniformly random) of extra work: once after the
    /// claim (in `prepare`, outside any transaction) and, a quarter of it, inside the
    /// fenced transaction after the first write. Widens the windows in which fault
    /// tests kill, stop or disconnect a worker.
    pub delay_ms: u64,
}

impl Chaos {
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

    async fn prepare_delay(&self) -> Result<serde_json::Value, StageError> {
        self.delay(self.delay_ms).await;
        Ok(serde_json::Value::Null)
    }

    async fn in_tx_delay(&self) {
        self.delay(self.delay_ms / 4).await;
    }

    fn maybe_crash(&self, stage: &str) -> Result<(), StageError> {
        if self.crash_rate <= 0.0 || rand::random::<f64>() >= self.crash_rate {
            return Ok(());
        }
        if rand::random::<bool>() {
            panic!("injected crash in {stage}");
        }
        Err(StageError::Transient(format!("injected crash in {stage}")))
    }
}

/// Cents per unit; a unit not listed here makes an anfrage infeasible.
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

/// Parses positions, one per non-empty line: `[quantity] [unit] description`, e.g.
/// `10 Stk Schrauben M8`, `2,5 m Kabel NYM`, `Montage vor Ort`.
pub fn extract_positions(text: &str) -> Vec<Extraktion> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let mut tokens = line.split_whitespace().peekable();
        let quantity = tokens
            .peek()
            .and_then(|t| t.replace(',', ".").parse::<f64>().ok())
            .filter(|q| q.is_finite() && *q >= 0.0);
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
    name: StageName,
    policy: StagePolicy,
    chaos: Chaos,
}

impl Named {
    fn new(name: &str, chaos: Chaos) -> Self {
        Self {
            name: StageName::parse(name).expect("valid stage name"),
            policy: StagePolicy::default(),
            chaos,
        }
    }
}

pub struct Intake(Named);
pub struct Extract(Named);
pub struct Feasibility(Named);
pub struct Calculate(Named);

macro_rules! named_stage {
    ($t:ident) => {
        impl $t {
            pub fn new(chaos: Chaos) -> Self {
                Self(Named::new(&stringify!($t).to_lowercase(), chaos))
            }
            pub fn with_policy(mut self, policy: StagePolicy) -> Self {
                self.0.policy = policy;
                self
            }
        }
    };
}
/// The `name` and `policy` of a stage wrapping `Named`.
macro_rules! named_identity {
    () => {
        fn name(&self) -> &StageName {
            &self.0.name
        }
        fn policy(&self) -> &StagePolicy {
            &self.0.policy
        }
    };
}

named_stage!(Intake);
named_stage!(Extract);
named_stage!(Feasibility);
named_stage!(Calculate);

#[async_trait]
impl Stage for Intake {
    named_identity!();
    async fn prepare(&self, _: &StageJob) -> Result<serde_json::Value, StageError> {
        self.0.chaos.prepare_delay().await
    }
    async fn run(
        &self,
        job: &StageJob,
        _: &serde_json::Value,
        tx: &mut dyn FencedTx,
    ) -> Result<StageFlow, StageError> {
        let text = tx.anfrage_text().await?;
        let sha = idemstage_domain::input_hash_of(text.as_bytes());
        let s3_key = format!("anfragen/{}/{}/input.txt", job.tenant_id, job.anfrage_id);
        // Insert-or-get; its audit entry names the id that exists.
        let datei = tx
            .insert_or_get_datei(&sha, &s3_key, text.len() as i64)
            .await?;
        self.0.chaos.in_tx_delay().await;
        self.0.chaos.maybe_crash("intake")?;
        tx.audit(
            &job.anfrage_id.to_string(),
            "anfrage.intake",
            json!({ "datei_id": datei.id.to_string() }),
        )
        .await?;
        Ok(StageFlow::Continue)
    }
}

#[async_trait]
impl Stage for Extract {
    named_identity!();
    async fn prepare(&self, _: &StageJob) -> Result<serde_json::Value, StageError> {
        self.0.chaos.prepare_delay().await
    }
    async fn run(
        &self,
        job: &StageJob,
        _: &serde_json::Value,
        tx: &mut dyn FencedTx,
    ) -> Result<StageFlow, StageError> {
        let text = tx.anfrage_text().await?;
        let positions = extract_positions(&text);
        tx.replace_extraktionen(&positions).await?;
        self.0.chaos.in_tx_delay().await;
        self.0.chaos.maybe_crash("extract")?;
        tx.audit(
            &job.anfrage_id.to_string(),
            "anfrage.extracted",
            json!({ "positions": positions.len() }),
        )
        .await?;
        Ok(StageFlow::Continue)
    }
}

/// Why an anfrage cannot be priced, one reason per problem.
pub fn feasibility_reasons(positions: &[Extraktion]) -> Vec<String> {
    if positions.is_empty() {
        return vec!["no positions found".into()];
    }
    let mut reasons = Vec::new();
    for p in positions {
        match (&p.quantity, &p.unit) {
            (None, _) => reasons.push(format!("position {}: quantity missing", p.position_index)),
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
    named_identity!();
    async fn prepare(&self, _: &StageJob) -> Result<serde_json::Value, StageError> {
        self.0.chaos.prepare_delay().await
    }
    async fn run(
        &self,
        _: &StageJob,
        _: &serde_json::Value,
        tx: &mut dyn FencedTx,
    ) -> Result<StageFlow, StageError> {
        let positions = tx.extraktionen().await?;
        let reasons = feasibility_reasons(&positions);
        let feasible = reasons.is_empty();
        tx.put_feasibility(feasible, json!(reasons)).await?;
        self.0.chaos.in_tx_delay().await;
        self.0.chaos.maybe_crash("feasibility")?;
        Ok(if feasible {
            StageFlow::Continue
        } else {
            StageFlow::Stop
        })
    }
}

#[async_trait]
impl Stage for Calculate {
    named_identity!();
    async fn prepare(&self, _: &StageJob) -> Result<serde_json::Value, StageError> {
        self.0.chaos.prepare_delay().await
    }
    async fn run(
        &self,
        job: &StageJob,
        _: &serde_json::Value,
        tx: &mut dyn FencedTx,
    ) -> Result<StageFlow, StageError> {
        let positions = tx.extraktionen().await?;
        let mut total = 0i64;
        let mut lines = Vec::new();
        for p in &positions {
            let (Some(q), Some(unit)) = (p.quantity, p.unit.as_deref()) else {
                return Err(StageError::Permanent(format!(
                    "position {} cannot be priced; feasibility should have stopped this",
                    p.position_index
                )));
            };
            let price = price_of(unit)
                .ok_or_else(|| StageError::Permanent(format!("no price for unit {unit:?}")))?;
            let cents = (q * price as f64).round() as i64;
            total += cents;
            lines.push(json!({ "position": p.position_index, "cents": cents }));
        }
        tx.put_calculation(total, json!(lines)).await?;
        self.0.chaos.in_tx_delay().await;
        self.0.chaos.maybe_crash("calculate")?;
        tx.audit(
            &job.anfrage_id.to_string(),
            "anfrage.calculated",
            json!({ "total_cents": total }),
        )
        .await?;
        Ok(StageFlow::Continue)
    }
}

/// The seed's four stages as one pipeline.
pub fn pipeline(chaos: Chaos) -> Pipeline {
    pipeline_with(chaos, StagePolicy::default())
        .expect("the example pipeline with default policies is valid")
}

/// The example pipeline with one policy for every stage (leases, attempts).
pub fn pipeline_with(chaos: Chaos, policy: StagePolicy) -> Result<Pipeline, crate::PipelineError> {
    Pipeline::new(vec![
        Arc::new(Intake::new(chaos).with_policy(policy.clone())),
        Arc::new(Extract::new(chaos).with_policy(policy.clone())),
        Arc::new(Feasibility::new(chaos).with_policy(policy.clone())),
        Arc::new(Calculate::new(chaos).with_policy(policy)),
    ])
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
}
