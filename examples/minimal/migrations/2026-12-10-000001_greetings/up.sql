-- minimal-pipeline: one row per anfrage, written by the `greet` stage.
-- Runs after the core's migrations (its domains and `anfragen`).
CREATE TABLE greetings (
    tenant_id  tenant_slug NOT NULL,
    anfrage_id ulid_text   NOT NULL,
    greeting   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, anfrage_id),
    FOREIGN KEY (tenant_id, anfrage_id) REFERENCES anfragen (tenant_id, id)
);

-- The core's tenant isolation: row-level security, and the grants a stage needs.
SELECT idemstage_tenant_table('greetings');
