-- The scheduler in charge, by epoch. Every scheduler write locks this row (FOR KEY SHARE) and
-- checks the epoch in the same statement, and a scheduler taking over updates it under
-- FOR UPDATE: so a write of a replaced scheduler that is still alive either committed before
-- the new one read its books or changes nothing (services/scheduler/store.py).
CREATE TABLE IF NOT EXISTS scheduler_leader (
    id     int PRIMARY KEY CHECK (id = 1),
    epoch  bigint NOT NULL
);
INSERT INTO scheduler_leader (id, epoch) VALUES (1, 0) ON CONFLICT DO NOTHING;
