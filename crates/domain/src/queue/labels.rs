//! A stage job's labels: the singleton key of a stage (`<stage>:<tenant>:<item>`)
//! and the check that a job's labels (its tenant, its key) agree with its payload,
//! as the database checks for every writer (the baseline migration).

use super::JobToSend;
use crate::DomainError;

/// The singleton key convention of the seed: `"{stage}:{tenant_id}:{item_id}"`.
pub fn stage_singleton_key(
    stage: &crate::StageName,
    tenant: &crate::TenantId,
    item: &crate::ItemId,
) -> String {
    format!("{stage}:{tenant}:{item}")
}

impl JobToSend {
    /// Refuses (`DomainError::InvalidPayload`) a job whose labels contradict its
    /// payload, as the database does for every writer (the baseline migration):
    ///
    /// - a payload that names a tenant (`"tenant_id"`, a valid slug) must be sent
    ///   for that tenant (`tenant`): a job labelled otherwise would escape that
    ///   tenant's pause, caps and fair share;
    /// - a singleton key of the stage form `<queue>:<tenant>:<item>`
    ///   ([`stage_singleton_key`]) must name the payload's tenant and item and
    ///   the job's tenant: only the stage's own job may hold the stage's key.
    ///
    /// Sends call it. A generic job is affected only if its payload has such a
    /// `tenant_id` or its key has the stage form.
    ///
    /// ```
    /// use idemstage_domain::{JobToSend, SendOptions, TenantId};
    /// let job = JobToSend {
    ///     queue: "extract".into(),
    ///     tenant: Some(TenantId::parse("t2").unwrap()),
    ///     payload: serde_json::json!({ "tenant_id": "t1" }),
    ///     options: SendOptions::default(),
    /// };
    /// assert!(job.validate_labels().is_err());
    /// ```
    pub fn validate_labels(&self) -> Result<(), DomainError> {
        let named = |field: &str| self.payload.get(field).and_then(serde_json::Value::as_str);
        let label = self.tenant.as_ref().map_or("", |t| t.as_str());
        let payload_tenant = named("tenant_id");
        if let Some(tenant) = payload_tenant.filter(|t| crate::TenantId::parse(t).is_ok()) {
            if tenant != label {
                return Err(DomainError::InvalidPayload(format!(
                    "queue {}: the payload names tenant {tenant} but the job is labelled {label:?}",
                    self.queue
                )));
            }
        }
        let Some((key_tenant, key_item)) = self.stage_key_parts() else {
            return Ok(());
        };
        if payload_tenant != Some(key_tenant)
            || named("item_id") != Some(key_item)
            || label != key_tenant
        {
            return Err(DomainError::InvalidPayload(format!(
                "queue {}: the singleton key is the stage job's of tenant {key_tenant} and \
                 item {key_item}, but the payload names tenant {} and item {} and \
                 the job is labelled {label:?}",
                self.queue,
                payload_tenant.unwrap_or("none"),
                named("item_id").unwrap_or("none"),
            )));
        }
        Ok(())
    }

    /// The tenant and item of a singleton key of the stage form
    /// `<queue>:<tenant>:<item>`, if the key has it.
    fn stage_key_parts(&self) -> Option<(&str, &str)> {
        let key = self.options.singleton_key.as_deref()?;
        let rest = key.strip_prefix(self.queue.as_str())?.strip_prefix(':')?;
        let (tenant, item) = rest.split_once(':')?;
        (crate::TenantId::parse(tenant).is_ok() && crate::ItemId::parse(item).is_ok())
            .then_some((tenant, item))
    }
}
