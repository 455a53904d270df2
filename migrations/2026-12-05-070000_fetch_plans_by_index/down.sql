ALTER FUNCTION idemstage_fetch(text[], integer) RESET enable_seqscan;
ALTER FUNCTION idemstage_fetch_queues(text[], integer) RESET enable_seqscan;
ALTER FUNCTION idemstage_fetch_plain(text, integer) RESET enable_seqscan;
ALTER FUNCTION idemstage_fetch_controlled(text, integer) RESET enable_seqscan;
ALTER FUNCTION idemstage_advance_floors(bigint, bigint, bigint, boolean) RESET enable_seqscan;
