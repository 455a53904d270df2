//! Our own `idemstage` binary: [`idemstage_cli`]'s command line for the seed's
//! example pipeline (intake → extract → feasibility → calculate), plus `demo`,
//! `bench`, and the seed worker's example-only flags (its stage lease, rerun on a
//! new input, and the fault injection the fault tests use). A team's binary is
//! `idemstage_cli::run_app` for its own pipeline and has none of these.

mod bench;
mod bulk;
mod demo;
mod fairness;
mod fan_out;
mod fixtures;
mod limits;
mod pressure;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args as _, FromArgMatches as _, Subcommand as _};
use idemstage::{pipeline::Pipeline, stage::InputChangePolicy, stage::StagePolicy};
use idemstage_cli::extend::{self, BadInput, GlobalArgs, WakeArg};
use idemstage_example::{self as example, Chaos};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

// The commands of ours only, beside idemstage-cli's (no doc comment: clap would
// take it for the binary's `about`).
#[derive(clap::Subcommand)]
enum DevCommand {
    /// The main job: duplicate sends, many workers, injected crashes; then a report
    /// checked against the database.
    Demo(demo::Args),
    /// Benchmarks: claim, queue or pipeline throughput (see BENCHMARKS.md). Empties
    /// every table: runs only on a database whose name contains "bench".
    Bench(bench::Args),
    /// The no-op queue's worker process of `bench pressure --workload queue`
    #[command(hide = true)]
    PressureWorker {
        /// Seconds a finished job is kept before maintenance deletes it
        /// (default: the worker's, 7 days)
        #[arg(long)]
        retention_s: Option<u64>,
    },
}

// `worker`'s flags for the seed pipeline (a team's stages carry their own
// policies, so idemstage-cli has none of these; no doc comment: clap would take it
// for `worker`'s `about`).
#[derive(clap::Args)]
struct ExampleWorker {
    /// Stage lease (claim) in milliseconds, renewed at a third of it [default: 30000]
    #[arg(long)]
    stage_lease_ms: Option<u64>,
    /// Re-run a finished stage when its item is sent again with another input
    /// (and invalidate the stages after it once the rerun succeeds); default: refuse
    /// another input
    #[arg(long)]
    rerun_on_new_input: bool,
    /// Fault injection: probability that a stage body aborts mid-way
    #[arg(long, default_value_t = 0.0, hide = true)]
    crash_rate: f64,
    /// Fault injection: up to this many ms of extra work per stage, after the claim
    /// and inside the fenced transaction (widens the windows fault tests hit)
    #[arg(long, default_value_t = 0, hide = true)]
    stage_delay_ms: u64,
    /// An infeasible item waits this many seconds for a person's review (the
    /// signal `review` to stage feasibility: `idemstage signal --stage
    /// feasibility --signal review --payload '{"approve":true}'`) before it
    /// stops; 0: it stops at once
    #[arg(long, default_value_t = 0)]
    review_infeasible_s: u64,
}

impl ExampleWorker {
    /// The seed pipeline (`fan_out`: its fan-out form) with these leases and faults.
    fn pipeline(&self, fan_out: bool) -> anyhow::Result<Pipeline> {
        if !(0.0..1.0).contains(&self.crash_rate) {
            return Err(BadInput("--crash-rate must be in [0, 1)".into()).into());
        }
        let stage_lease_ms = self.stage_lease_ms.unwrap_or(30_000);
        if stage_lease_ms < 30 {
            return Err(BadInput("--stage-lease-ms must be >= 30".into()).into());
        }
        let stage_lease = Duration::from_millis(stage_lease_ms);
        let policy = StagePolicy::default()
            .with_on_input_change(if self.rerun_on_new_input {
                InputChangePolicy::Rerun
            } else {
                InputChangePolicy::Reject
            })
            .with_lease(stage_lease)
            .with_heartbeat(stage_lease / 3);
        let review =
            (self.review_infeasible_s > 0).then(|| Duration::from_secs(self.review_infeasible_s));
        let chaos = Chaos {
            crash_rate: self.crash_rate,
            delay_ms: self.stage_delay_ms,
        };
        if fan_out {
            if review.is_some() {
                return Err(BadInput(
                    "--review-infeasible-s waits in the item's feasibility; with --fan-out \
                     feasibility runs per position"
                        .into(),
                )
                .into());
            }
            return Ok(
                example::fan_out_pipeline(chaos, policy).map_err(|e| BadInput(e.to_string()))?
            );
        }
        Ok(example::pipeline_with_options(chaos, policy, None, review)
            .map_err(|e| BadInput(e.to_string()))?)
    }
}

/// The id of the global `--fan-out` flag.
const FAN_OUT: &str = "fan_out";

fn command() -> clap::Command {
    let command = extend::command()
        .about("idemstage's own binary: the seed's example pipeline, its demo and benchmarks")
        .arg(
            clap::Arg::new(FAN_OUT)
                .long("fan-out")
                .global(true)
                .action(clap::ArgAction::SetTrue)
                .help(
                    "The seed pipeline's fan-out form: extract fans out one child per \
                     position, feasibility runs per position and calculate gathers their \
                     verdicts (the same stage names). For the worker, and for the operator \
                     commands and the console over its items",
                ),
        )
        .mut_subcommand("worker", ExampleWorker::augment_args);
    DevCommand::augment_subcommands(command)
}

fn main() -> ExitCode {
    let matches = command().get_matches();
    extend::block_on(async move {
        let ours = matches
            .subcommand_name()
            .is_some_and(DevCommand::has_subcommand);
        if ours {
            // The demo injects crashes on purpose: its warnings would drown the report.
            extend::init_logging("error");
            let result = async {
                let command = DevCommand::from_arg_matches(&matches)?;
                let db = GlobalArgs::from_matches(&matches)?.db()?;
                match command {
                    DevCommand::Demo(args) => {
                        db.direct_only("demo")?;
                        demo::run(&db.url, args).await
                    }
                    DevCommand::Bench(args) => {
                        db.direct_only("bench")?;
                        bench::run(&db.url, args).await
                    }
                    DevCommand::PressureWorker { retention_s } => {
                        pressure::queue_worker(&db.url, retention_s).await
                    }
                }
            }
            .await;
            return extend::exit_code(result);
        }
        extend::init_logging("warn");
        // A global flag: set before or after the subcommand, it is in the
        // subcommand's matches.
        let fan_out = matches
            .subcommand()
            .map_or(matches.get_flag(FAN_OUT), |(_, sub)| sub.get_flag(FAN_OUT));
        let pipeline = match matches.subcommand() {
            Some(("worker", worker)) => {
                match ExampleWorker::from_arg_matches(worker)
                    .map_err(anyhow::Error::from)
                    .and_then(|w| w.pipeline(fan_out))
                {
                    Ok(pipeline) => pipeline,
                    Err(e) => return extend::exit_code(Err(e)),
                }
            }
            _ if fan_out => {
                match example::fan_out_pipeline(Chaos::default(), StagePolicy::default()) {
                    Ok(pipeline) => pipeline,
                    Err(e) => return extend::exit_code(Err(BadInput(e.to_string()).into())),
                }
            }
            _ => example::pipeline(Chaos::default()),
        };
        let app = idemstage_cli::App::new(pipeline).with_migrations(vec![example::MIGRATIONS]);
        extend::run_matches(app, &matches).await
    })
}

#[cfg(test)]
mod tests {
    /// Every flag of every command has its own name (clap checks this only when
    /// a debug build parses that command).
    #[test]
    fn the_command_line_is_consistent() {
        super::command().debug_assert();
    }
}
