DROP POLICY queue_work ON public.queue_buckets;
DROP POLICY queue_work ON public.jobs;
DROP POLICY tenant_isolation ON public.jobs;
ALTER TABLE public.queue_buckets DISABLE ROW LEVEL SECURITY;
ALTER TABLE public.jobs DISABLE ROW LEVEL SECURITY;
