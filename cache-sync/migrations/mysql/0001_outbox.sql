-- cache-sync's transactional outbox on MariaDB (tested on 10.11) or MySQL 8
-- (feature `mysql-outbox`), in the database `cache_sync`. `Outbox::migrate`
-- runs exactly these statements (with the schema it was built with), one
-- at a time, under GET_LOCK; use this file instead when your own migration
-- tool owns the database. Every statement is idempotent. Names and caches
-- are kept as bytes (VARBINARY), whatever the server's default charset.
CREATE DATABASE IF NOT EXISTS cache_sync;

-- One row per change to publish, in id order. Ids are taken only while the
-- cache's enqueue lock (its row in `versions`) is held, so per cache they
-- follow commit order. `change` is the encoded change (a format byte, then
-- bincode); `not_before` (microseconds since the Unix epoch, by the
-- database's clock) holds a delayed second invalidation back until due.
CREATE TABLE IF NOT EXISTS cache_sync.outbox (
    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    cache VARBINARY(255) NOT NULL,
    `change` LONGBLOB NOT NULL,
    not_before BIGINT NULL
) ENGINE = InnoDB;

-- The last automatic version handed out per cache (microseconds since the
-- Unix epoch, made strictly increasing), raised by caller versions. A
-- writer's row lock on its cache's row is the cache's enqueue lock.
CREATE TABLE IF NOT EXISTS cache_sync.versions (
    cache VARBINARY(255) NOT NULL PRIMARY KEY,
    version BIGINT NOT NULL
) ENGINE = InnoDB;

-- One row: a random number naming this outbox on the wire, so that terms
-- of two outboxes publishing to one cache are never compared, and the last
-- fencing term a relay drew. A relay that takes the leader lock draws the
-- next term in a statement of its own, committed at once, so a replaced
-- relay's term is always below its successor's.
CREATE TABLE IF NOT EXISTS cache_sync.relay (
    one TINYINT NOT NULL PRIMARY KEY,
    scope BIGINT NOT NULL,
    term BIGINT NOT NULL
) ENGINE = InnoDB;

-- 60 random bits: the first 15 hex digits of a hash of a fresh UUID.
INSERT IGNORE INTO cache_sync.relay (one, scope, term)
    VALUES (1, CAST(CONV(LEFT(SHA2(CONCAT(UUID(), RAND()), 256), 15), 16, 10) AS SIGNED), 0);
