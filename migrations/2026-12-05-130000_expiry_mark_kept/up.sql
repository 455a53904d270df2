-- The expiry mark keeps its one row (issue 31). Expiry moves the mark with
-- an UPDATE, and caps and the floors' run read it. Without the row, caps
-- counted no open claim and expiry looked from the start for ever and never
-- moved it. The row's key (`only_row`, always true) allows no second row; a
-- DELETE or TRUNCATE of it is refused here. To start the mark over, UPDATE it.
CREATE FUNCTION idemstage_expiry_mark_kept() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'job_expiry_mark keeps its one row: expiry and caps read it (update it instead)'
        USING ERRCODE = 'restrict_violation';
END
$$;
CREATE TRIGGER job_expiry_mark_kept BEFORE DELETE ON job_expiry_mark
    FOR EACH ROW EXECUTE FUNCTION idemstage_expiry_mark_kept();
CREATE TRIGGER job_expiry_mark_not_truncated BEFORE TRUNCATE ON job_expiry_mark
    FOR EACH STATEMENT EXECUTE FUNCTION idemstage_expiry_mark_kept();
