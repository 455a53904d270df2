-- The reconciler's list of open anfragen (000200) under row-level security, as
-- the queue's tables are (000172): inside the tenant scope (a stage body, start_in,
-- the reconciler's settling) only the scope's tenant's rows are read, added or
-- deleted. Before, a stage body read every tenant's anfrage ids and could delete
-- another tenant's rows, so that its lost stages were never sent again.
--
-- Outside the scope the worker's and the operator's login roles keep what their
-- grants of 000200 say (the reconciler reads the batch across tenants; a send
-- outside the scope adds its anfrage). Not FORCEd: the owner works as before.
ALTER TABLE public.anfragen_open ENABLE ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON public.anfragen_open TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));

CREATE POLICY queue_work ON public.anfragen_open TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
