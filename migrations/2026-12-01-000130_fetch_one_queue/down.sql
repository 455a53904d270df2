DROP FUNCTION idemstage_fetch(text[], integer);
ALTER FUNCTION idemstage_fetch_queues(text[], integer) RENAME TO idemstage_fetch;
