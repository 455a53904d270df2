//! `idemstage rerun | retry | cancel` over many items: the filters, the preview
//! (`--dry-run`), the run in batches and `--resume` (`idemstage::ops::run_bulk`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use idemstage::ops::{self, Actor, BulkAction, BulkFilter, BulkPreview, BulkProgress};
use idemstage::pipeline::Pipeline;
use idemstage::{ids::BulkId, ids::ItemId, ids::StageName, ids::TenantId};

use super::BadInput;

/// The filters and the run of a bulk action.
#[derive(clap::Args, Debug, Default)]
pub struct BulkArgs {
    /// Only items whose run of --stage has this status (repeat, or separate
    /// with commas: success,dead)
    #[arg(long, value_delimiter = ',')]
    status: Vec<String>,
    /// Only items registered at or after this time (RFC 3339, e.g.
    /// 2026-11-27T00:00:00Z)
    #[arg(long)]
    since: Option<String>,
    /// Only items registered before this time (RFC 3339)
    #[arg(long)]
    until: Option<String>,
    /// Only the items in this file (one item id per line; blank lines and
    /// lines starting with # are skipped)
    #[arg(long)]
    items_file: Option<PathBuf>,
    /// Items per transaction (1 to 10000)
    #[arg(long, default_value_t = 100)]
    batch_size: u32,
    /// Print what would be selected (counts by tenant and status) and change
    /// nothing
    #[arg(long)]
    dry_run: bool,
    /// Go on with the bulk action of this id (after a crash or a stop); its
    /// own filters are used
    #[arg(long)]
    resume: Option<String>,
}

impl BulkArgs {
    /// Whether any flag of a bulk action was given (an item's command takes none).
    pub fn any(&self) -> bool {
        !self.status.is_empty()
            || self.since.is_some()
            || self.until.is_some()
            || self.items_file.is_some()
            || self.dry_run
            || self.resume.is_some()
    }
}

fn items_file(path: &PathBuf) -> anyhow::Result<Vec<ItemId>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| BadInput(format!("--items-file {}: {e}", path.display())))?;
    let mut items = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        items.push(ItemId::parse(line).map_err(|e| {
            BadInput(format!(
                "--items-file {} line {}: {e}",
                path.display(),
                n + 1
            ))
        })?);
    }
    // An id listed twice is one item.
    items.sort();
    items.dedup();
    Ok(items)
}

/// The filter of the flags, checked before the first connection.
fn filter(
    action: BulkAction,
    tenant: Option<&str>,
    stage: Option<StageName>,
    args: &BulkArgs,
) -> anyhow::Result<BulkFilter> {
    let statuses = BulkFilter::parse_statuses(&args.status.join(","))?;
    let time = |flag: &str, value: Option<&str>| {
        value
            .map(|v| BulkFilter::parse_time(&format!("--{flag}"), v))
            .transpose()
    };
    let filter = BulkFilter {
        tenant: tenant.map(TenantId::parse).transpose()?,
        stage,
        statuses,
        since: time("since", args.since.as_deref())?,
        until: time("until", args.until.as_deref())?,
        items: args.items_file.as_ref().map(items_file).transpose()?,
    };
    filter.check(action)?;
    Ok(filter)
}

/// Runs a bulk `action` (or resumes one): the preview first, then (unless
/// `--dry-run`) the batches; progress on stderr, the outcome on stdout.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    db: &super::Db,
    action: BulkAction,
    tenant: Option<&str>,
    stage: Option<StageName>,
    args: &BulkArgs,
    actor: Option<Actor>,
    json: bool,
    pipeline: &Pipeline,
) -> anyhow::Result<ExitCode> {
    let resume = args.resume.as_deref().map(BulkId::parse).transpose()?;
    let new_filter = match resume {
        Some(_) => None,
        None => Some(filter(action, tenant, stage, args)?),
    };
    let mut conn = db.connect().await?;
    let actor = super::ops::actor(actor, &mut conn).await?;
    let (preview, progress) = match (resume, new_filter) {
        (Some(id), _) => {
            let progress = ops::bulk_progress(&mut conn, &id).await?;
            if progress.action != action {
                return Err(BadInput(format!(
                    "bulk action {id} is a {}, not a {action}: resume it with `idemstage {}`",
                    progress.action, progress.action
                ))
                .into());
            }
            let preview = ops::preview(&mut conn, action, &progress.filter).await?;
            if !args.dry_run && !json {
                print_preview(&preview);
            }
            (preview, (!args.dry_run).then_some(progress))
        }
        (None, Some(filter)) => {
            if let Some(tenant) = &filter.tenant {
                super::known::tenant(&mut conn, tenant).await?;
            }
            let preview = ops::preview(&mut conn, action, &filter).await?;
            if !args.dry_run && !json {
                print_preview(&preview);
            }
            let progress = if args.dry_run {
                None
            } else {
                Some(ops::start_bulk(&mut conn, action, &filter, &actor, args.batch_size).await?)
            };
            (preview, progress)
        }
        (None, None) => unreachable!("a filter without --resume"),
    };
    let Some(progress) = progress else {
        if json {
            println!(
                "{}",
                serde_json::json!({ "preview": preview, "dry_run": true })
            );
        } else {
            print_preview(&preview);
            println!("dry run: nothing was changed");
        }
        return Ok(ExitCode::SUCCESS);
    };
    eprintln!(
        "bulk {action} {}: resume with `--resume {}` if it stops",
        progress.id, progress.id
    );
    let _ = std::io::stderr().flush();
    let id = progress.id;
    let done = ops::run_bulk(&mut conn, &id, &actor, pipeline, |p: &BulkProgress| {
        tracing::info!(
            bulk = %p.id, batches = p.batches, taken = p.selected, acted = p.acted,
            "bulk batch committed"
        );
    })
    .await?;
    if json {
        println!(
            "{}",
            serde_json::json!({ "preview": preview, "bulk": done })
        );
    } else {
        println!(
            "bulk {action} {}: {} items taken in {} batches, {} {}",
            done.id,
            done.selected,
            done.batches,
            done.acted,
            match action {
                BulkAction::Rerun => "rerun",
                BulkAction::Retry => "retried",
                BulkAction::Cancel => "cancelled",
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn print_preview(preview: &BulkPreview) {
    println!("{:<16} {:<10} {:>8}", "tenant", "state", "items");
    for g in &preview.groups {
        println!("{:<16} {:<10} {:>8}", g.tenant.as_str(), g.state, g.items);
    }
    println!(
        "{} {}: {} items selected, {} to act on as things stand",
        preview.action,
        if preview.selected == 0 {
            "(nothing)"
        } else {
            "preview"
        },
        preview.selected,
        preview.eligible
    );
}
