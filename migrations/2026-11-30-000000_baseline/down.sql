-- Removes everything the baseline created in this database. The roles
-- (idemstage_app, idemstage_worker, idemstage_operator) and their memberships are
-- per server and stay: other databases on the server may still use them.
DROP TABLE audit_log, items_open, queue_control_changes, queue_buckets CASCADE;
DROP TABLE queue_controls, jobs, stage_checkpoints, stage_run_attempts CASCADE;
DROP TABLE stage_runs, item_inputs, items CASCADE;
DROP FUNCTION idemstage_fetch(text[], integer);
DROP FUNCTION idemstage_fetch_queues(text[], integer);
DROP FUNCTION idemstage_fetch_plain(text, integer);
DROP FUNCTION idemstage_fetch_controlled(text, integer);
DROP FUNCTION idemstage_fetch_wait(text[]);
DROP FUNCTION idemstage_actor_tag();
DROP FUNCTION idemstage_record_control_change();
DROP FUNCTION idemstage_tenant_table(regclass);
DROP FUNCTION idemstage_open_item(text, text);
DROP FUNCTION idemstage_jobs_check_labels();
DROP FUNCTION idemstage_items_open();
DROP FUNCTION items_keep_replaced_input();
DROP FUNCTION stage_runs_record_attempt();
DROP DOMAIN ulid_text, tenant_slug, stage_name;
