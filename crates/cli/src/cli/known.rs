//! What a command checks about a stage or a tenant it names before it writes (or
//! filters) anything: the stage is one of the pipeline's, the tenant has
//! registered an item. The console decides the same way (404), so a typo
//! changes nothing on either: a control row for `extrakt`, or for a tenant that
//! does not exist, would be written and pause nobody.

use diesel_async::AsyncPgConnection;
use idemstage::pipeline::Pipeline;
use idemstage::{ids::StageName, ids::TenantId};

/// A stage or a tenant that nobody has (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum Unknown {
    /// Not a stage of the pipeline.
    #[error("unknown stage {name:?}: not a stage of the pipeline ({stages}); nothing was changed")]
    Stage {
        /// The name given.
        name: String,
        /// The pipeline's stages, in order, for the message.
        stages: String,
    },
    /// No item of this tenant is registered.
    #[error(
        "unknown tenant {0}: it has no items (a tenant is known from its first item on); \
         nothing was changed"
    )]
    Tenant(TenantId),
}

/// `name` as a stage of `pipeline`.
pub(crate) fn stage(pipeline: &Pipeline, name: &str) -> anyhow::Result<StageName> {
    let stage = StageName::parse(name)?;
    if pipeline.stage(stage.as_str()).is_err() {
        let stages: Vec<&str> = pipeline
            .stages()
            .iter()
            .map(|s| s.name().as_str())
            .collect();
        return Err(Unknown::Stage {
            name: name.to_owned(),
            stages: stages.join(", "),
        }
        .into());
    }
    Ok(stage)
}

/// Refuses a tenant without items. Checked before the write, in a statement of
/// its own: items are never deleted, so a tenant known here stays known.
pub(crate) async fn tenant(conn: &mut AsyncPgConnection, tenant: &TenantId) -> anyhow::Result<()> {
    if idemstage::report::tenant_exists(conn, tenant).await? {
        Ok(())
    } else {
        Err(Unknown::Tenant(tenant.clone()).into())
    }
}
