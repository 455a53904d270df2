//! `idemstage status`: stage x status counts and queue state counts.

use std::process::ExitCode;

use idemstage::ids::TenantId;
use idemstage::report::stage_status_counts;

#[derive(clap::Args)]
pub struct Args {
    /// Only this tenant's runs
    #[arg(long)]
    tenant: Option<String>,
    /// One JSON object instead of tables
    #[arg(long)]
    json: bool,
}

pub async fn run(db: &super::Db, args: Args) -> anyhow::Result<ExitCode> {
    let tenant = args.tenant.as_deref().map(TenantId::parse).transpose()?;
    let mut conn = db.connect().await?;
    let stages = stage_status_counts(&mut conn, tenant.as_ref()).await?;
    // Jobs carry no tenant column: queue counts are for all tenants.
    let queues = idemstage::queue::queue_stats(&mut conn).await?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "stages": stages, "queues": queues.queues })
        );
    } else {
        println!("{:<16} {:<10} {:>10}", "stage", "status", "runs");
        for s in &stages {
            println!("{:<16} {:<10} {:>10}", s.stage, s.status, s.count);
        }
        println!();
        println!(
            "{:<16} {:>8} {:>8} {:>8} {:>10} {:>10} {:>8}",
            "queue", "created", "retry", "active", "completed", "cancelled", "failed"
        );
        for (name, c) in &queues.queues {
            println!(
                "{:<16} {:>8} {:>8} {:>8} {:>10} {:>10} {:>8}",
                name, c.created, c.retry, c.active, c.completed, c.cancelled, c.failed
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
