DROP FUNCTION idemstage_fetch_wait(text[]);
