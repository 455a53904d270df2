//! `idemstage bench pressure`'s flags: the cell (its stress), the workload and
//! the phases.

use super::load::INPUT;
use super::BadInput;
use idemstage_example::{self as example, Chaos};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Cell {
    /// No stress: the stress phase runs at the offered rate
    Clean,
    /// One connection holds a transaction with an XID for the stress phase
    IdleInTx,
    /// Four REPEATABLE READ connections scan `jobs` in one snapshot each
    ActiveReaders,
    /// 1.5x the offered rate
    SustainedHighLoad,
    /// 2x the offered rate (an oversupply around the peak), then catch-up
    EventBurst,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// The example pipeline's four stages per item, `idemstage worker` processes
    Pipeline,
    /// No-op jobs of one queue, `QueueWorker` processes in the drain bench's
    /// fastest setting (concurrency 16, prefetch 512)
    Queue,
    /// The example pipeline with a fan-out (`worker --fan-out`): per item
    /// intake, extract, one feasibility per position (children) and the
    /// gathering calculate
    FanOut,
}

impl Workload {
    pub(super) fn name(self) -> &'static str {
        match self {
            Workload::Pipeline => "pipeline",
            Workload::Queue => "queue",
            Workload::FanOut => "fan-out",
        }
    }

    /// Jobs per unit sent (an item: one per stage; a queue job: one).
    pub(super) fn jobs_per_unit(self) -> f64 {
        match self {
            Workload::Pipeline => example::pipeline(Chaos::default()).stages().len() as f64,
            Workload::Queue => 1.0,
            // intake, extract, calculate, and one feasibility per position.
            Workload::FanOut => 3.0 + example::extract_positions(INPUT).len() as f64,
        }
    }
}

/// `idemstage bench pressure`'s flags.
#[derive(clap::Args)]
pub struct PressureArgs {
    /// pressure: the stress of the cell
    #[arg(long, value_enum, default_value_t = Cell::IdleInTx)]
    pub cell: Cell,
    /// pressure: what the workers work
    #[arg(long, value_enum, default_value_t = Workload::Pipeline)]
    pub workload: Workload,
    /// pressure: items per second offered in the clean and recovery phases (each
    /// item is four stage jobs); default: half the workers' peak, measured first
    /// by draining a backlog of --peak-items
    #[arg(long)]
    pub items_per_s: Option<f64>,
    /// pressure: the backlog (items; the queue workload: four times as many
    /// jobs) whose drain measures the workers' peak
    #[arg(long, default_value_t = 1500)]
    pub peak_items: u64,
    /// pressure: seconds of the warm-up at the offered rate before the clean
    /// phase, sampled but left out of the summary (0: none)
    #[arg(long, default_value_t = 30.0)]
    pub warmup_s: f64,
    /// pressure: seconds of the clean phase
    #[arg(long, default_value_t = 60.0)]
    pub clean_s: f64,
    /// pressure: seconds of the stress phase
    #[arg(long, default_value_t = 240.0)]
    pub stress_s: f64,
    /// pressure: seconds of the recovery phase
    #[arg(long, default_value_t = 120.0)]
    pub recovery_s: f64,
    /// pressure: seconds between two samples
    #[arg(long, default_value_t = 5.0)]
    pub sample_every_s: f64,
    /// pressure: `idemstage worker` processes, each at its default concurrency
    #[arg(long, default_value_t = 2)]
    pub pressure_workers: usize,
    /// pressure: the pipeline workers' `--prefetch` (0: their default, fetching
    /// only for free slots)
    #[arg(long, default_value_t = 0)]
    pub pressure_prefetch: usize,
    /// pressure: seconds the no-op queue's workers keep a finished job before
    /// their maintenance deletes it (default: 7 days, so a run of hours never
    /// reaches the retention; a short one shows the steady state's deletes)
    #[arg(long)]
    pub pressure_retention_s: Option<u64>,
    /// pressure: tenants the items are sent for, round-robin
    #[arg(long, default_value_t = 4)]
    pub tenants: usize,
}

impl PressureArgs {
    /// Refuses what cannot be measured, before anything touches the database.
    pub fn check(&self) -> Result<(), BadInput> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if ![
            self.clean_s,
            self.stress_s,
            self.recovery_s,
            self.sample_every_s,
        ]
        .into_iter()
        .all(positive)
            || !(positive(self.warmup_s) || self.warmup_s == 0.0)
            || self.items_per_s.is_some_and(|r| !positive(r))
            || self.peak_items == 0
            || self.pressure_workers == 0
            || self.tenants == 0
            || self.pressure_retention_s == Some(0)
        {
            return Err(BadInput(
                "pressure: --items-per-s, --peak-items, the phases' seconds, --sample-every-s, \
                 --pressure-workers, --pressure-retention-s and --tenants must be positive \
                 (--warmup-s may be 0)"
                    .into(),
            ));
        }
        if self.pressure_retention_s.is_some() && self.workload != Workload::Queue {
            return Err(BadInput(
                "pressure: --pressure-retention-s is the no-op queue's (--workload queue)".into(),
            ));
        }
        Ok(())
    }
}

impl Cell {
    pub(super) fn name(self) -> &'static str {
        match self {
            Cell::Clean => "clean",
            Cell::IdleInTx => "idle_in_tx",
            Cell::ActiveReaders => "active_readers",
            Cell::SustainedHighLoad => "sustained_high_load",
            Cell::EventBurst => "event_burst",
        }
    }

    pub(super) fn multiplier(self) -> f64 {
        match self {
            Cell::SustainedHighLoad => 1.5,
            Cell::EventBurst => 2.0,
            _ => 1.0,
        }
    }
}
