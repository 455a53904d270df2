-- The example pipeline's own tables, applied after the core's migrations
-- (`idemstage::migrate_with(url, vec![idemstage_example::MIGRATIONS])`). They use
-- the core's domains (ulid_text, tenant_slug), reference its items and
-- stage_runs by (tenant_id, ...) so that no row can point across tenants, and
-- put themselves under its tenant isolation with one line each
-- (idemstage_tenant_table).

-- The item's input as a stored file (the seed's "Datei"): one row per
-- (tenant, content, key), written by the intake stage with insert-or-get.
CREATE TABLE dateien (
    id         ulid_text   NOT NULL PRIMARY KEY,
    tenant_id  tenant_slug NOT NULL,
    item_id ulid_text   NOT NULL,
    -- A character class with `*` plus a length test: linear in PostgreSQL's regex
    -- engine, unlike `{64}` (see the core's 2026-11-30-000000_baseline).
    sha256     text        NOT NULL CHECK (sha256 ~ '^[0-9a-f]*$' AND length(sha256) = 64),
    s3_key     text        NOT NULL,
    size_bytes bigint      NOT NULL CHECK (size_bytes >= 0),
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT dateien_item_fk FOREIGN KEY (tenant_id, item_id)
        REFERENCES items (tenant_id, id)
);
CREATE UNIQUE INDEX dateien_tenant_sha256_s3_key_uq ON dateien (tenant_id, sha256, s3_key);

-- Child rows carry the run and attempt that wrote them, so that "children belong
-- only to the successful attempt" is a plain SQL check.
CREATE TABLE anfrage_extraktionen (
    id             ulid_text   NOT NULL PRIMARY KEY,
    tenant_id      tenant_slug NOT NULL,
    item_id     ulid_text   NOT NULL,
    position_index integer     NOT NULL CHECK (position_index >= 0),
    description    text        NOT NULL,
    quantity       double precision,
    unit           text,
    run_id         ulid_text   NOT NULL,
    attempt        integer     NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT anfrage_extraktionen_item_fk FOREIGN KEY (tenant_id, item_id)
        REFERENCES items (tenant_id, id),
    CONSTRAINT anfrage_extraktionen_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES stage_runs (tenant_id, id)
);
CREATE UNIQUE INDEX anfrage_extraktionen_tenant_item_position_uq
    ON anfrage_extraktionen (tenant_id, item_id, position_index);

CREATE TABLE feasibility_results (
    tenant_id  tenant_slug NOT NULL,
    item_id ulid_text   NOT NULL,
    feasible   boolean     NOT NULL,
    reasons    jsonb       NOT NULL DEFAULT '[]',
    run_id     ulid_text   NOT NULL,
    attempt    integer     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id),
    CONSTRAINT feasibility_results_item_fk FOREIGN KEY (tenant_id, item_id)
        REFERENCES items (tenant_id, id),
    CONSTRAINT feasibility_results_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES stage_runs (tenant_id, id)
);

CREATE TABLE calculation_results (
    tenant_id   tenant_slug NOT NULL,
    item_id  ulid_text   NOT NULL,
    total_cents bigint      NOT NULL,
    currency    text        NOT NULL DEFAULT 'EUR',
    lines       jsonb       NOT NULL DEFAULT '[]',
    run_id      ulid_text   NOT NULL,
    attempt     integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id),
    CONSTRAINT calculation_results_item_fk FOREIGN KEY (tenant_id, item_id)
        REFERENCES items (tenant_id, id),
    CONSTRAINT calculation_results_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES stage_runs (tenant_id, id)
);

SELECT idemstage_tenant_table('dateien');
SELECT idemstage_tenant_table('anfrage_extraktionen');
SELECT idemstage_tenant_table('feasibility_results');
SELECT idemstage_tenant_table('calculation_results');
