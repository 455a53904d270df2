ALTER DOMAIN ulid_text DROP CONSTRAINT ulid_text_check;
ALTER DOMAIN ulid_text ADD CONSTRAINT ulid_text_check
    CHECK (VALUE ~ '^[0-7][0-9A-HJKMNP-TV-Z]{25}$');
ALTER DOMAIN tenant_slug DROP CONSTRAINT tenant_slug_check;
ALTER DOMAIN tenant_slug ADD CONSTRAINT tenant_slug_check
    CHECK (VALUE ~ '^[a-z0-9][a-z0-9_-]{0,62}$');
ALTER DOMAIN stage_name DROP CONSTRAINT stage_name_check;
ALTER DOMAIN stage_name ADD CONSTRAINT stage_name_check
    CHECK (VALUE ~ '^[a-z][a-z0-9_]{0,62}$');
ALTER TABLE anfragen DROP CONSTRAINT anfragen_input_sha256_check,
    ADD CONSTRAINT anfragen_input_sha256_check CHECK (input_sha256 ~ '^[0-9a-f]{64}$');
ALTER TABLE jobs DROP CONSTRAINT jobs_queue_check,
    ADD CONSTRAINT jobs_queue_check CHECK (queue ~ '^[A-Za-z0-9_.:-]{1,100}$');
