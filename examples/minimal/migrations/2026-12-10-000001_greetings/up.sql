-- minimal-pipeline: one row per item, written by the `greet` stage.
-- Runs after the core's migrations (its domains and `items`).
CREATE TABLE greetings (
    tenant_id  tenant_slug NOT NULL,
    item_id ulid_text   NOT NULL,
    greeting   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id),
    FOREIGN KEY (tenant_id, item_id) REFERENCES items (tenant_id, id)
);

-- The core's tenant isolation: row-level security, and the grants a stage needs.
SELECT idemstage_tenant_table('greetings');
