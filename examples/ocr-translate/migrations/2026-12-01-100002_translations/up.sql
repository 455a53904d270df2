-- ocr-translate: the `translate` stage's result, one row per ocr page. Besides
-- the attempt that wrote it (run_id, attempt), a row names the ocr attempt whose
-- pages it translated (ocr_run_id, ocr_attempt): its lineage, checkable in plain
-- SQL against pipeline_runs.success_attempt.
CREATE TABLE translations (
    tenant_id   tenant_slug NOT NULL,
    anfrage_id  ulid_text   NOT NULL,
    page        integer     NOT NULL CHECK (page >= 1),
    text        text        NOT NULL,
    run_id      ulid_text   NOT NULL,
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    ocr_run_id  ulid_text   NOT NULL,
    ocr_attempt integer     NOT NULL CHECK (ocr_attempt >= 1),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, anfrage_id, page),
    CONSTRAINT translations_anfrage_fk FOREIGN KEY (tenant_id, anfrage_id)
        REFERENCES anfragen (tenant_id, id),
    CONSTRAINT translations_run_fk FOREIGN KEY (tenant_id, run_id)
        REFERENCES pipeline_runs (tenant_id, id),
    CONSTRAINT translations_ocr_run_fk FOREIGN KEY (tenant_id, ocr_run_id)
        REFERENCES pipeline_runs (tenant_id, id)
);

SELECT idemstage_tenant_table('translations');
