-- Tangram's system of record: actions and their transitions, environments, nodes, epochs.

CREATE TABLE IF NOT EXISTS actions (
    action_id      text PRIMARY KEY,
    job_id         text NOT NULL,
    trajectory_id  text NOT NULL,
    kind           text NOT NULL,
    status         text NOT NULL CHECK (status IN ('queued','running','succeeded','failed','cancelled')),
    attempt        int  NOT NULL DEFAULT 0,
    node_id        text,
    incarnation    text,
    cores          int[],
    spec           bytea NOT NULL,          -- the UnifiedAction, msgpack
    result         bytea,                   -- the ActionResult, msgpack, once terminal
    error_kind     text,
    exit_code      int,
    submitted_at   double precision NOT NULL,
    started_at     double precision,
    finished_at    double precision,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS actions_open ON actions (submitted_at)
    WHERE status IN ('queued', 'running');
CREATE INDEX IF NOT EXISTS actions_trajectory ON actions (trajectory_id);
CREATE INDEX IF NOT EXISTS actions_job ON actions (job_id);

-- One row per transition; (action_id, attempt, status) makes replays harmless.
CREATE TABLE IF NOT EXISTS action_events (
    action_id  text NOT NULL,
    attempt    int  NOT NULL,
    status     text NOT NULL,
    node_id    text,
    detail     text NOT NULL DEFAULT '',
    at         double precision NOT NULL,
    PRIMARY KEY (action_id, attempt, status)
);

CREATE TABLE IF NOT EXISTS envs (
    trajectory_id text PRIMARY KEY,
    job_id        text NOT NULL,
    node_id       text NOT NULL,
    incarnation   text NOT NULL,
    memory_mb     int  NOT NULL,
    status        text NOT NULL CHECK (status IN ('active','closed','lost','expired')),
    reason        text NOT NULL DEFAULT '',
    created_at    double precision NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS nodes (
    node_id      text PRIMARY KEY,
    incarnation  text NOT NULL,
    inventory    bytea NOT NULL,
    status       text NOT NULL,
    seen_at      timestamptz NOT NULL DEFAULT now()
);

-- Each scheduler start takes a new epoch; node agents refuse dispatches of older epochs.
CREATE SEQUENCE IF NOT EXISTS scheduler_epoch;
