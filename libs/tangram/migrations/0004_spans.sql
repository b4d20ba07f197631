-- Finished spans shipped by every service, kept by the dashboard for its trace waterfalls.
-- Unlogged: trace detail is not the system of record (an action's timings live on its row),
-- and skipping the WAL keeps the cost of storing spans off the commits of the hot path; a
-- crash of Postgres empties it. Bounded by the dashboard's retention (age and row count).
CREATE UNLOGGED TABLE IF NOT EXISTS spans (
    trace_id   text NOT NULL,
    span_id    text NOT NULL,
    parent_id  text NOT NULL DEFAULT '',
    action_id  text NOT NULL DEFAULT '',
    name       text NOT NULL,
    service    text NOT NULL,
    start_at   double precision NOT NULL,
    end_at     double precision NOT NULL,
    error      boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS spans_trace ON spans (trace_id);
CREATE INDEX IF NOT EXISTS spans_action ON spans (action_id) WHERE action_id <> '';
CREATE INDEX IF NOT EXISTS spans_start ON spans (start_at);
