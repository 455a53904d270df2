-- invoice-pipeline: a tenant's vendors, found or created by the `vendor` stage
-- (insert-or-get on the normalized name). A BIGSERIAL key: the table's sequence
-- is granted to the stages' scope by idemstage_tenant_table.
CREATE TABLE vendors (
    id         bigserial   PRIMARY KEY,
    tenant_id  tenant_slug NOT NULL,
    name_key   text        NOT NULL,
    name       text        NOT NULL,
    tax_id     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT vendors_tenant_name_uq UNIQUE (tenant_id, name_key),
    -- For the invoices' composite key: an invoice cannot name another tenant's vendor.
    CONSTRAINT vendors_tenant_id_uq UNIQUE (tenant_id, id)
);

SELECT idemstage_tenant_table('vendors');
