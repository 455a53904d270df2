-- A rerun of a fan-out stage (its new success: another attempt) replaces its
-- children: the new attempt's children are new items (their ids derive from
-- the attempt), and the old ones are superseded. `items.superseded_at` marks
-- such a child: the claim does not bind its input and the lineage check of
-- its commit fails (both read the item's row already: no further probe), so
-- nothing of an old child starts or commits after the rerun; its runs are
-- cancelled with no current success in the same transaction, and the
-- reconciler and the checkers expect nothing of it.
ALTER TABLE items ADD COLUMN superseded_at timestamptz;
