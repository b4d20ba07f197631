-- Resources declared once for the whole mesh: model services and quotas. ``spec`` is the
-- msgpack of ServiceSpec / QuotaSpec; the gateway writes a row before it tells the scheduler,
-- and a restarted scheduler reloads them.

CREATE TABLE IF NOT EXISTS services (
    name        text PRIMARY KEY,
    spec        bytea NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS quotas (
    name        text PRIMARY KEY,
    spec        bytea NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
