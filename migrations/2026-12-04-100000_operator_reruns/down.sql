-- Operator reruns and bulk actions go (migration 2026-12-04-100000_operator_reruns).
DROP TABLE bulk_actions;
DROP TABLE stage_reruns;
