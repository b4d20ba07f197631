-- Who owns what (per-client credentials, `tangram client add`): the client credential that
-- submitted an action ('' = the operator's door, or a mesh without auth), and which client a
-- trajectory (its environment) belongs to, claimed by its first action. The gateway refuses a
-- client another's action (not_found) and another's trajectory (invalid_request).
ALTER TABLE actions ADD COLUMN IF NOT EXISTS owner text NOT NULL DEFAULT '';
CREATE TABLE IF NOT EXISTS trajectory_owners (
    trajectory_id text PRIMARY KEY,
    owner         text NOT NULL
);
