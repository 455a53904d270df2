-- invoice-pipeline: the invoice the `book` stage books (one per item) and its
-- lines (child rows, replaced as a whole by the booking).
CREATE TABLE invoices (
    tenant_id   tenant_slug NOT NULL,
    item_id  ulid_text   NOT NULL,
    vendor_id   bigint      NOT NULL,
    number      text        NOT NULL,
    total_cents bigint      NOT NULL,
    booked_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, item_id),
    FOREIGN KEY (tenant_id, item_id) REFERENCES items (tenant_id, id),
    FOREIGN KEY (tenant_id, vendor_id) REFERENCES vendors (tenant_id, id)
);

CREATE TABLE invoice_lines (
    tenant_id        tenant_slug NOT NULL,
    item_id       ulid_text   NOT NULL,
    position         integer     NOT NULL CHECK (position >= 1),
    description      text        NOT NULL,
    quantity         bigint      NOT NULL,
    unit_price_cents bigint      NOT NULL,
    PRIMARY KEY (tenant_id, item_id, position),
    FOREIGN KEY (tenant_id, item_id) REFERENCES invoices (tenant_id, item_id)
);

SELECT idemstage_tenant_table('invoices');
SELECT idemstage_tenant_table('invoice_lines');
