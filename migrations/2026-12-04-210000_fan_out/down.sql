DROP TRIGGER stage_runs_child_created_ended ON stage_runs;
DROP TRIGGER stage_runs_child_ended ON stage_runs;
DROP FUNCTION idemstage_child_ended();
DROP FUNCTION idemstage_child_final(text, text, text, text);
DROP TABLE fanout_children;
DROP TABLE fanouts;
