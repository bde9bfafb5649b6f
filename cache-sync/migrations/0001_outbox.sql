-- cache-sync's transactional outbox (feature `postgres`), in the schema
-- `cache_sync`. `Outbox::migrate` runs exactly this (with the schema it was
-- built with) under an advisory lock; use this file instead when your own
-- migration tool owns the database. Needs PostgreSQL 14 or later.
CREATE SCHEMA IF NOT EXISTS cache_sync;

-- Row ids. Taken only while the cache's enqueue lock is held, so per cache
-- they follow commit order.
CREATE SEQUENCE IF NOT EXISTS cache_sync.outbox_id_seq;

-- One row per change to publish. `change` is the encoded change (a format
-- byte, then bincode); `not_before` holds a delayed second invalidation
-- back until it is due.
CREATE TABLE IF NOT EXISTS cache_sync.outbox (
    id bigint PRIMARY KEY,
    cache text NOT NULL,
    change bytea NOT NULL,
    not_before timestamptz
);

-- The last automatic version handed out per cache (microseconds since the
-- Unix epoch, made strictly increasing), raised by caller versions.
CREATE TABLE IF NOT EXISTS cache_sync.versions (
    cache text PRIMARY KEY,
    version bigint NOT NULL
);

-- Wakes the relays. A notification is delivered at commit, and not at all
-- for a rolled-back transaction; relays also poll, for lost ones.
CREATE OR REPLACE FUNCTION cache_sync.outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('cache_sync_outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER outbox_notify AFTER INSERT ON cache_sync.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION cache_sync.outbox_notify();
