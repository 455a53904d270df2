-- The queue's tables under row-level security for the tenant scope.
--
-- Inside the scope (role idemstage_app with app.tenant_id: a stage body in its
-- fenced transaction, start_in, an operator's retry, cancel or inspect) the
-- queue is that tenant's: jobs whose tenant_id is the scope's, read, sent and
-- updated; a job sent there carries the scope's tenant (a job of no tenant, ''
-- is refused too: send it outside the scope). Before, a stage body read every
-- tenant's job payloads and sent jobs under any tenant's label. The scope gets
-- nothing of queue_buckets (it never had a grant; now no policy either).
--
-- Outside the scope the worker's and the operator's login roles keep the whole
-- queue, as their grants of 000110 say: the fetch sees every tenant's jobs and
-- spends every bucket, maintenance takes back and removes any finished job,
-- completions and renewals name jobs by id. That is what a worker login role
-- can still do directly (RELIABILITY.md, "Not promised").
--
-- Not FORCEd: the owner (migrations, the tests' superuser) works the queue as
-- before.
ALTER TABLE public.jobs ENABLE ROW LEVEL SECURITY;
ALTER TABLE public.queue_buckets ENABLE ROW LEVEL SECURITY;

CREATE POLICY tenant_isolation ON public.jobs TO idemstage_app
    USING (tenant_id = current_setting('app.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('app.tenant_id', true));

CREATE POLICY queue_work ON public.jobs TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
CREATE POLICY queue_work ON public.queue_buckets TO idemstage_worker, idemstage_operator
    USING (true) WITH CHECK (true);
