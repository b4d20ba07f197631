-- Health transitions of node agents (robustrl §4): healthy -> suspect -> fenced -> failed, and
-- back to healthy when a suspect answers its probe. Written by the leading scheduler's health
-- detector (services/scheduler/health.py); read by `tangram status` and by people after an
-- incident. Append-only: transitions are rare (a handful per failure), so it is not pruned.
CREATE TABLE IF NOT EXISTS health_events (
    id           bigserial PRIMARY KEY,
    at           timestamptz NOT NULL,
    node_id      text NOT NULL,
    incarnation  text NOT NULL,
    role         text NOT NULL,
    old_state    text NOT NULL,
    new_state    text NOT NULL,
    reason       text NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS health_events_node ON health_events (node_id, at);
