DROP TRIGGER queue_controls_changes ON queue_controls;
DROP FUNCTION idemstage_record_control_change();
DROP TABLE queue_control_changes;
