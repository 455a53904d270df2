GRANT UPDATE, DELETE ON public.audit_log TO idemstage_app;
