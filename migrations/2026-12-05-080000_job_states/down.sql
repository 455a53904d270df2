DROP VIEW job_states;
