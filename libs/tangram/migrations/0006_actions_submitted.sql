-- The dashboard lists the newest actions and plots ACT over recent ones: by submit time, on an
-- index written once at insert (submitted_at never changes), not a scan of the whole table.
CREATE INDEX IF NOT EXISTS actions_submitted ON actions (submitted_at);
