ALTER TABLE items DROP COLUMN superseded_at;
