DROP POLICY queue_work ON public.anfragen_open;
DROP POLICY tenant_isolation ON public.anfragen_open;
ALTER TABLE public.anfragen_open DISABLE ROW LEVEL SECURITY;
