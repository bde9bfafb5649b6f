-- cache-sync's transactional outbox, second migration: the relay's fence,
-- in the schema `cache_sync`. `Outbox::migrate` runs it after the first; use
-- this file when your own migration tool owns the database. Idempotent.

-- Every pass of a relay that holds the leader lock takes a term from this
-- sequence, and every event it publishes carries it. `nextval` is not
-- transactional: a relay whose session died keeps the term it had, and
-- the relay that took over draws a higher one, so nodes can tell the late
-- events of the replaced relay from the new relay's (they apply the old
-- one's refreshes as invalidations).
CREATE SEQUENCE IF NOT EXISTS cache_sync.relay_term_seq;

-- One row: a random number naming this outbox on the wire, so that terms
-- of two outboxes (two databases, two schemas) publishing to one cache are
-- never compared with each other.
CREATE TABLE IF NOT EXISTS cache_sync.relay (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    scope bigint NOT NULL
);

INSERT INTO cache_sync.relay (scope)
    VALUES (('x' || md5(random()::text || clock_timestamp()::text))::bit(64)::bigint)
    ON CONFLICT DO NOTHING;
