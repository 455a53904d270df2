-- ocr-translate: the pages the `ocr` stage found in an item's input, one row
-- per page. Replaced as a whole by every successful ocr attempt. Which attempt
-- that was is the core's to say (`stage_runs.success_attempt`, whose `output`
-- holds the same pages): the rows carry no lineage of their own.
--
-- Runs after the core's migrations (`idemstage::migrate_with`): it uses the core's
-- domains and references its items, keyed by tenant so that a row cannot point
-- at another tenant's item.
CREATE TABLE ocr_pages (
    id         ulid_text   NOT NULL PRIMARY KEY,
    tenant_id  tenant_slug NOT NULL,
    item_id ulid_text   NOT NULL,
    page       integer     NOT NULL CHECK (page >= 1),
    text       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT ocr_pages_tenant_item_page_uq UNIQUE (tenant_id, item_id, page),
    CONSTRAINT ocr_pages_item_fk FOREIGN KEY (tenant_id, item_id)
        REFERENCES items (tenant_id, id)
);

-- The core's tenant isolation (row-level security for idemstage_app).
SELECT idemstage_tenant_table('ocr_pages');
