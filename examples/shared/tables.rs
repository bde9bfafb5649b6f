//! The table the `node` and `admin` examples share. In an application this
//! lives in a crate that both the admin service and the nodes depend on, so
//! the cache's name and its key and value types cannot drift apart.

use cache_sync::Table;

/// Country code to name. `None` caches a row that does not exist, so a
/// lookup of an unknown code stays off the database; the admin publishes
/// `Some(name)` for a row it writes.
pub(crate) const COUNTRIES: Table<String, Option<String>> = Table::new("countries");
