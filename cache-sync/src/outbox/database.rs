//! The databases an outbox lives in: the connections an [`Outbox`] enqueues
//! on and the pools its relay and migration use, each PostgreSQL's or
//! MySQL's, as the features built.
//!
//! [`Outbox`]: super::Outbox

/// A connection an [`Outbox`](super::Outbox) enqueues on, in the caller's
/// open transaction: `sqlx`'s `PgConnection` (feature `postgres-outbox`)
/// or `MySqlConnection` (feature `mysql-outbox`), or a `sqlx::Transaction`
/// or pooled connection of either. Sealed: the outbox's SQL exists for
/// these only.
pub trait OutboxConnection: sealed::Connection + Send {}

/// A pool an [`OutboxRelay`](super::OutboxRelay) reads and
/// [`Outbox::migrate`](super::Outbox::migrate) runs on: `sqlx::PgPool`
/// (feature `postgres-outbox`) or `sqlx::MySqlPool` (feature
/// `mysql-outbox`). Sealed.
pub trait OutboxPool: sealed::Pool + Send + Sync {}

/// One of the connections the outbox speaks to, borrowed. `pub` only to
/// appear in the sealed traits: the module is private, so nothing outside
/// the crate can name it.
#[derive(Debug)]
pub enum Conn<'a> {
    #[cfg(feature = "postgres-outbox")]
    Pg(&'a mut sqlx::PgConnection),
    #[cfg(feature = "mysql-outbox")]
    MySql(&'a mut sqlx::MySqlConnection),
}

/// One of the pools the outbox speaks to, cloned (a pool is a handle).
#[derive(Clone, Debug)]
pub enum Pool {
    #[cfg(feature = "postgres-outbox")]
    Pg(sqlx::PgPool),
    #[cfg(feature = "mysql-outbox")]
    MySql(sqlx::MySqlPool),
}

pub(super) mod sealed {
    /// Hands the outbox the connection under a caller's type. In a private
    /// module: outside the crate it can be neither named nor implemented.
    pub trait Connection {
        fn conn(&mut self) -> super::Conn<'_>;
    }

    pub trait Pool {
        fn pool(&self) -> super::Pool;
    }
}

#[cfg(feature = "postgres-outbox")]
impl sealed::Connection for sqlx::PgConnection {
    fn conn(&mut self) -> Conn<'_> {
        Conn::Pg(self)
    }
}

#[cfg(feature = "postgres-outbox")]
impl OutboxConnection for sqlx::PgConnection {}

#[cfg(feature = "mysql-outbox")]
impl sealed::Connection for sqlx::MySqlConnection {
    fn conn(&mut self) -> Conn<'_> {
        Conn::MySql(self)
    }
}

#[cfg(feature = "mysql-outbox")]
impl OutboxConnection for sqlx::MySqlConnection {}

// A transaction or a pooled connection is its connection: callers pass
// `&mut tx` as they would to sqlx itself.
impl<DB: sqlx::Database> sealed::Connection for sqlx::Transaction<'_, DB>
where
    DB::Connection: sealed::Connection,
{
    fn conn(&mut self) -> Conn<'_> {
        (**self).conn()
    }
}

impl<DB: sqlx::Database> OutboxConnection for sqlx::Transaction<'_, DB> where
    DB::Connection: OutboxConnection
{
}

impl<DB: sqlx::Database> sealed::Connection for sqlx::pool::PoolConnection<DB>
where
    DB::Connection: sealed::Connection,
{
    fn conn(&mut self) -> Conn<'_> {
        (**self).conn()
    }
}

impl<DB: sqlx::Database> OutboxConnection for sqlx::pool::PoolConnection<DB> where
    DB::Connection: OutboxConnection
{
}

#[cfg(feature = "postgres-outbox")]
impl sealed::Pool for sqlx::PgPool {
    fn pool(&self) -> Pool {
        Pool::Pg(self.clone())
    }
}

#[cfg(feature = "postgres-outbox")]
impl OutboxPool for sqlx::PgPool {}

#[cfg(feature = "mysql-outbox")]
impl sealed::Pool for sqlx::MySqlPool {
    fn pool(&self) -> Pool {
        Pool::MySql(self.clone())
    }
}

#[cfg(feature = "mysql-outbox")]
impl OutboxPool for sqlx::MySqlPool {}
