//! The seed pipeline with a fan-out: `extract` hands on one child per
//! extracted position, `feasibility` checks each position as a child of its
//! own (at most once per position, fenced, under the stage's caps and rates),
//! and `calculate` gathers their verdicts once every position is final, then
//! prices the item or records why it cannot be priced.

use idemstage::serde_json::json;
use idemstage::{
    async_trait, fenced::FencedTx, pipeline::Pipeline, pipeline::PipelineError, stage::Children,
    stage::Done, stage::GatherPolicy, stage::Gathered, stage::PrepareContext, stage::Stage,
    stage::StageError, stage::StagePolicy,
};
use serde::{Deserialize, Serialize};

use crate::stages::{extract_positions, feasibility_reasons, price_positions, Chaos, Intake};
use crate::tables::{ExampleTables, Extraktion};

/// What `feasibility` finds for one position: why it cannot be priced (none:
/// it can).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PositionVerdict {
    /// The position's number in the item.
    pub position_index: i32,
    /// Why it cannot be priced; empty: it can.
    pub reasons: Vec<String>,
}

/// Stage 2 of the fan-out pipeline: the positions, as the linear pipeline's
/// `extract` stores them, and one child per position (key: its number).
pub struct ExtractPositions {
    policy: StagePolicy,
    chaos: Chaos,
}

/// Stage 3, per position: can it be priced?
pub struct PositionFeasibility {
    policy: StagePolicy,
    chaos: Chaos,
}

/// Stage 4, the gather: every position's verdict; prices the item if all can
/// be priced, else records why not and stops.
pub struct GatherCalculate {
    policy: StagePolicy,
    chaos: Chaos,
}

#[async_trait]
impl Stage for ExtractPositions {
    const NAME: &'static str = "extract";
    type Input = ();
    type Prepared = ();
    type Output = Children<Extraktion>;
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        self.chaos.prepare_delay().await
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _: &(),
        _: &(),
    ) -> Result<Done<Children<Extraktion>>, StageError> {
        let item = tx.token().item.to_string();
        let positions = extract_positions(&tx.item_text().await?);
        tx.replace_extraktionen(&positions).await?;
        self.chaos.in_tx_delay().await;
        self.chaos.maybe_crash("extract")?;
        tx.audit(
            &item,
            "item.extracted",
            json!({ "positions": positions.len() }),
        )
        .await?;
        Ok(Done::next(
            positions
                .into_iter()
                .map(|p| (p.position_index.to_string(), p))
                .collect(),
        ))
    }
}

#[async_trait]
impl Stage for PositionFeasibility {
    const NAME: &'static str = "feasibility";
    type Input = Extraktion;
    type Prepared = ();
    type Output = PositionVerdict;
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn prepare(&self, _: &PrepareContext<'_, Extraktion>) -> Result<(), StageError> {
        self.chaos.prepare_delay().await
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        position: &Extraktion,
        _: &(),
    ) -> Result<Done<PositionVerdict>, StageError> {
        self.chaos.in_tx_delay().await;
        self.chaos.maybe_crash("feasibility")?;
        Ok(Done::next(PositionVerdict {
            position_index: position.position_index,
            reasons: feasibility_reasons(std::slice::from_ref(position)),
        }))
    }
}

#[async_trait]
impl Stage for GatherCalculate {
    const NAME: &'static str = "calculate";
    type Input = Gathered<PositionVerdict>;
    type Prepared = ();
    type Output = ();
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn prepare(
        &self,
        _: &PrepareContext<'_, Gathered<PositionVerdict>>,
    ) -> Result<(), StageError> {
        self.chaos.prepare_delay().await
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        verdicts: &Gathered<PositionVerdict>,
        _: &(),
    ) -> Result<Done<()>, StageError> {
        let item = tx.token().item.to_string();
        let mut reasons: Vec<String> = verdicts
            .succeeded()
            .flat_map(|(_, v)| v.reasons.iter().cloned())
            .chain(
                verdicts
                    .failed()
                    .map(|(key, why)| format!("position {key}: {why}")),
            )
            .collect();
        if verdicts.children.is_empty() {
            reasons.push("no positions found".into());
        }
        let feasible = reasons.is_empty();
        tx.put_feasibility(feasible, json!(reasons)).await?;
        if !feasible {
            return Ok(Done::stop(()));
        }
        let positions: Vec<Extraktion> = tx.extraktionen().await?;
        let (total, lines) =
            price_positions(&positions).map_err(|e| StageError::Permanent(e.to_string().into()))?;
        tx.put_calculation(total, json!(lines)).await?;
        self.chaos.in_tx_delay().await;
        self.chaos.maybe_crash("calculate")?;
        tx.audit(&item, "item.calculated", json!({ "total_cents": total }))
            .await?;
        Ok(Done::next(()))
    }
}

/// The seed pipeline with `extract` fanning out per position, `feasibility`
/// per position and `calculate` gathering them (a dead position check is
/// gathered as a reason the item cannot be priced). The stage names are the
/// linear pipeline's, so the command line's stage names hold for both.
pub fn fan_out_pipeline(chaos: Chaos, policy: StagePolicy) -> Result<Pipeline, PipelineError> {
    Pipeline::builder(Intake::new(chaos).with_policy(policy.clone()))
        .fan_out(ExtractPositions {
            policy: policy.clone(),
            chaos,
        })
        .then(PositionFeasibility {
            policy: policy.clone(),
            chaos,
        })
        .gather(
            GatherCalculate { policy, chaos },
            GatherPolicy::GatherSucceeded,
        )
        .build()
}
