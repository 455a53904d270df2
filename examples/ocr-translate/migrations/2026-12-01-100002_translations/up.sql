-- ocr-translate: the `translate` stage's result, one row per ocr page. The pages
-- it translated are its input, the output of the ocr attempt its run is bound to
-- (`stage_runs.upstream_attempt`): the core keeps that lineage, the rows do
-- not repeat it.
CREATE TABLE translations (
    tenant_id   tenant_slug NOT NULL,
    item_id  ulid_text   NOT NULL,
    page        integer     NOT NULL CHECK (page >= 1),
    text        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id, page),
    CONSTRAINT translations_item_fk FOREIGN KEY (tenant_id, item_id)
        REFERENCES items (tenant_id, id)
);

SELECT idemstage_tenant_table('translations');
