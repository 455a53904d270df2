-- Interruptions given back uncounted are bounded (issue 29, item 5). An attempt
-- that a retryable database error interrupts is released without counting
-- against max_attempts; an error that only looked passing (a statement the driver
-- refused, classed as a lost connection) was released, claimed and released
-- again every few seconds, for ever. Now only `max_interruptions` (the stage's
-- policy) attempts in a row are given back; the next interrupted one counts as
-- failed, with its error (INTERRUPT in persistence/src/runs/sql.rs).
--
-- interruptions        how many attempts in a row, up to interrupted_attempt, were
--                      interrupted and given back uncounted
-- interrupted_attempt  the last attempt given back that way (NULL: none yet). The
--                      row continues only while it is the attempt just before the
--                      one interrupted now: any other end of an attempt (success,
--                      failure, a lease taken over, a shutdown's release, a rate
--                      limit) lets the next interruption start a new row, so no
--                      other statement has to reset the count.
ALTER TABLE pipeline_runs
    ADD COLUMN interruptions integer NOT NULL DEFAULT 0
        CONSTRAINT pipeline_runs_interruptions_ck CHECK (interruptions >= 0),
    ADD COLUMN interrupted_attempt integer
        CONSTRAINT pipeline_runs_interrupted_attempt_ck CHECK (interrupted_attempt >= 1);
