//! Where a Redis transport's commands go: one server, or a Redis Cluster.
//!
//! On a cluster, publishes and other one-shot commands go through the
//! `redis` crate's cluster connection, which follows `MOVED` and `ASK`,
//! retries `TRYAGAIN` and refreshes its slot map after a failover. A
//! blocking reader does not: it holds a connection of its own to the master
//! that serves its key, found by following `MOVED` from the seeds, and any
//! redirect or lost connection ends its subscription, so the node subscribes
//! again from its position and the resume checks run (a reader carried over
//! to a promoted replica without a word would read a history that may have
//! lost entries as if it were the old one).

use std::fmt;
use std::sync::{Arc, Mutex};

use futures_util::FutureExt as _;
use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Client, Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo,
    Pipeline, ProtocolVersion, RedisFuture, Value,
};
use redis::{RedisError, RedisResult};

use super::map_err;
use crate::error::{Error, Result};
use crate::util::lock;

/// Redirects a reader follows before it gives up: a slot map that moves
/// under it more often than this is a cluster in the middle of a change,
/// and the node's backoff tries again.
const MAX_HOPS: usize = 5;

/// Where a builder connects: one server's URL, or a cluster's seeds.
#[derive(Debug, Clone)]
pub(super) enum Target {
    Server(String),
    Cluster(Vec<String>),
}

/// One server, or a cluster's seeds.
pub(super) enum Servers {
    Single(Client),
    Cluster {
        seeds: Vec<ConnectionInfo>,
        /// The server that served the last reader's key: tried first.
        last_owner: Mutex<Option<ConnectionInfo>>,
    },
}

impl fmt::Debug for Servers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Servers::Single(_) => f.write_str("Single"),
            Servers::Cluster { seeds, .. } => write!(f, "Cluster({} seeds)", seeds.len()),
        }
    }
}

/// A connection for one-shot commands: a connection manager to one server,
/// or a cluster connection.
#[derive(Clone)]
pub(super) enum Commands {
    Single(ConnectionManager),
    Cluster(Arc<Renewing>),
}

/// A cluster connection made again after a timeout or a lost connection.
///
/// The `redis` crate's cluster connection learns of a failover from a
/// redirect or a connection that fails, but a master that is paused (or cut
/// off) keeps its connection open and only times out: the connection sends
/// every command for its slots there until told otherwise, which nothing
/// does (seen: a publisher timing out for minutes after the replica took
/// over). A new one reads the slot map afresh from the seeds, where the
/// failover shows. The command that timed out still fails: a publish is
/// never sent twice behind its caller's back.
pub(super) struct Renewing {
    client: ClusterClient,
    current: Mutex<ClusterConnection>,
    /// Held while a new connection is made: one at a time, the others go on
    /// with the current one meanwhile.
    renewing: tokio::sync::Mutex<()>,
}

impl Renewing {
    fn current(&self) -> ClusterConnection {
        lock(&self.current).clone()
    }

    /// After `result`, makes a new connection if it says the server did
    /// not answer or the connection broke.
    async fn after<T>(&self, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(e) = &result
            && lost(e)
            && let Ok(_one_at_a_time) = self.renewing.try_lock()
            && let Ok(fresh) = self.client.get_async_connection().await
        {
            *lock(&self.current) = fresh;
        }
        result
    }
}

/// Whether an error says the server did not answer, or the connection
/// broke: what a failover looks like to a client of the old master.
fn lost(e: &RedisError) -> bool {
    e.is_timeout() || e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
}

impl ConnectionLike for Commands {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Commands::Single(c) => c.req_packed_command(cmd),
            Commands::Cluster(r) => async move {
                let result = r.current().req_packed_command(cmd).await;
                r.after(result).await
            }
            .boxed(),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Commands::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Commands::Cluster(r) => async move {
                let result = r
                    .current()
                    .req_packed_commands(pipeline, offset, count)
                    .await;
                r.after(result).await
            }
            .boxed(),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Commands::Single(c) => c.get_db(),
            Commands::Cluster(_) => 0,
        }
    }
}

impl Servers {
    /// The servers `target` names. A server URL of the scheme
    /// [`CLUSTER_SCHEME`] names a cluster's seeds.
    pub(super) fn open(target: &Target) -> Result<Self> {
        match target {
            Target::Server(url) => match cluster_seeds(url) {
                Some(seeds) => Self::cluster(&seeds),
                None => Self::single(url),
            },
            Target::Cluster(seeds) => Self::cluster(seeds),
        }
    }

    /// The same servers, spoken to in `protocol` (RESP3 for push messages).
    pub(super) fn with_protocol(&self, protocol: ProtocolVersion) -> Result<Self> {
        Ok(match self {
            Servers::Single(client) => Servers::Single(
                Client::open(in_protocol(client.get_connection_info(), protocol))
                    .map_err(|e| Error::Config(e.to_string()))?,
            ),
            Servers::Cluster { seeds, .. } => Servers::Cluster {
                seeds: seeds.iter().map(|s| in_protocol(s, protocol)).collect(),
                last_owner: Mutex::new(None),
            },
        })
    }

    /// Whether these are a cluster's seeds.
    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Servers::Cluster { .. })
    }

    /// One server at `url`.
    pub(super) fn single(url: &str) -> Result<Self> {
        Client::open(url)
            .map(Servers::Single)
            .map_err(|e| Error::Config(e.to_string()))
    }

    /// A cluster reached through `seeds` (any of its servers; at least
    /// one).
    pub(super) fn cluster(seeds: &[String]) -> Result<Self> {
        if seeds.is_empty() {
            return Err(Error::Config(
                "a Redis Cluster needs at least one seed address".into(),
            ));
        }
        let seeds = seeds
            .iter()
            .map(|s| {
                let info = s
                    .as_str()
                    .into_connection_info()
                    .map_err(|e| Error::Config(format!("seed {s:?}: {e}")))?;
                match info.addr() {
                    ConnectionAddr::Tcp(..) => Ok(info),
                    _ => Err(Error::Config(format!(
                        "seed {s:?}: a Redis Cluster is reached over plain TCP (redis://host:port)"
                    ))),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Servers::Cluster {
            seeds,
            last_owner: Mutex::new(None),
        })
    }

    /// A connection for one-shot commands, each step bounded by `timeout`.
    pub(super) async fn commands(
        &self,
        transport: &'static str,
        timeout: std::time::Duration,
    ) -> Result<Commands> {
        match self {
            Servers::Single(client) => client
                .get_connection_manager_with_config(super::manager_config(timeout))
                .await
                .map(Commands::Single)
                .map_err(|e| map_err(transport, e)),
            Servers::Cluster { seeds, .. } => {
                let client = ClusterClientBuilder::new(seeds.clone())
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .build()
                    .map_err(|e| Error::Config(e.to_string()))?;
                let conn = client
                    .get_async_connection()
                    .await
                    .map_err(|e| map_err(transport, e))?;
                Ok(Commands::Cluster(Arc::new(Renewing {
                    client,
                    current: Mutex::new(conn),
                    renewing: tokio::sync::Mutex::new(()),
                })))
            }
        }
    }

    /// A classic Pub/Sub connection to the one server, or to the first seed
    /// of a cluster that answers (a cluster forwards classic messages to
    /// every node).
    pub(super) async fn pubsub(&self, transport: &'static str) -> Result<redis::aio::PubSub> {
        let seeds = match self {
            Servers::Single(client) => {
                return client
                    .get_async_pubsub()
                    .await
                    .map_err(|e| map_err(transport, e));
            }
            Servers::Cluster { seeds, .. } => seeds,
        };
        let mut last_error = None;
        for seed in seeds {
            let pubsub = match Client::open(seed.clone()) {
                Ok(client) => client.get_async_pubsub().await,
                Err(e) => Err(e),
            };
            match pubsub {
                Ok(pubsub) => return Ok(pubsub),
                Err(e) => last_error = Some(map_err(transport, e)),
            }
        }
        Err(last_error.unwrap_or_else(|| {
            Error::Config("a Redis Cluster needs at least one seed address".into())
        }))
    }

    /// Refuses a server older than Redis 7.0 (`what` says what needs it),
    /// asked of one server: a cluster connection would ask every master
    /// and answer with a map of their replies.
    pub(super) async fn require_redis_7(
        &self,
        transport: &'static str,
        timeout: std::time::Duration,
        what: &'static str,
    ) -> Result<()> {
        let one = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut self.any(&one, transport).await?)
            .await
            .map_err(|e| map_err(transport, e))?;
        let major = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .and_then(|v| v.split('.').next()?.parse::<u32>().ok());
        if major.is_none_or(|major| major < 7) {
            return Err(Error::Unsupported { transport, what });
        }
        Ok(())
    }

    /// A connection to the one server, or to the first seed of a cluster
    /// that answers: for what any server can tell (its version).
    pub(super) async fn any(
        &self,
        config: &AsyncConnectionConfig,
        transport: &'static str,
    ) -> Result<MultiplexedConnection> {
        let seeds = match self {
            Servers::Single(client) => {
                return client
                    .get_multiplexed_async_connection_with_config(config)
                    .await
                    .map_err(|e| map_err(transport, e));
            }
            Servers::Cluster { seeds, .. } => seeds,
        };
        let mut last_error = None;
        for seed in seeds {
            match connect(seed, config).await {
                Ok(conn) => return Ok(conn),
                Err(e) => last_error = Some(map_err(transport, e)),
            }
        }
        Err(last_error.unwrap_or_else(|| {
            Error::Config("a Redis Cluster needs at least one seed address".into())
        }))
    }

    /// A connection of its own to the server that serves `key`: the one
    /// server, or on a cluster the master its slot is on now.
    pub(super) async fn connection_for(
        &self,
        key: &str,
        config: &AsyncConnectionConfig,
        transport: &'static str,
    ) -> Result<MultiplexedConnection> {
        let (seeds, last_owner) = match self {
            Servers::Single(client) => {
                return client
                    .get_multiplexed_async_connection_with_config(config)
                    .await
                    .map_err(|e| map_err(transport, e));
            }
            Servers::Cluster { seeds, last_owner } => (seeds, last_owner),
        };
        let first = lock(last_owner).clone();
        let mut last_error = None;
        for start in first.iter().chain(seeds) {
            let mut at = start.clone();
            for _ in 0..MAX_HOPS {
                let mut conn = match connect(&at, config).await {
                    Ok(conn) => conn,
                    Err(e) => {
                        // Down (a failed master): the next seed.
                        forget(last_owner, &at);
                        last_error = Some(map_err(transport, e));
                        break;
                    }
                };
                // A key command: the server answers it, or says where
                // the key's slot is served (`MOVED`).
                match redis::cmd("EXISTS")
                    .arg(key)
                    .query_async::<i64>(&mut conn)
                    .await
                {
                    Ok(_) => {
                        *lock(last_owner) = Some(at);
                        return Ok(conn);
                    }
                    Err(e) => match e.redirect_node().and_then(|(addr, _)| moved_to(&at, addr)) {
                        Some(next)
                            if e.kind()
                                == redis::ErrorKind::Server(redis::ServerErrorKind::Moved) =>
                        {
                            at = next;
                        }
                        _ => {
                            // A slot being migrated (`ASK`), a cluster that
                            // is down for now, a server that does not
                            // answer (paused, cut off): the next seed, and
                            // the node tries again later. Not first next
                            // time: a paused master would cost each try a
                            // timeout.
                            forget(last_owner, &at);
                            last_error = Some(map_err(transport, e));
                            break;
                        }
                    },
                }
            }
        }
        Err(last_error.unwrap_or_else(|| {
            Error::Config("a Redis Cluster needs at least one seed address".into())
        }))
    }
}

/// The scheme of a URL that names a Redis Cluster by its seeds:
/// `redis+cluster://[user:password@]host:port[,host:port…][/db][?params]`.
pub(super) const CLUSTER_SCHEME: &str = "redis+cluster://";

/// The seeds a [`CLUSTER_SCHEME`] URL names, each a `redis://` URL with the
/// URL's credentials, database and parameters; `None` for another scheme.
fn cluster_seeds(url: &str) -> Option<Vec<String>> {
    let rest = url.strip_prefix(CLUSTER_SCHEME)?;
    let (hosts, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    let (user, hosts) = match hosts.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), hosts),
    };
    Some(
        hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("redis://{user}{h}{tail}"))
            .collect(),
    )
}

/// `info` in `protocol`.
fn in_protocol(info: &ConnectionInfo, protocol: ProtocolVersion) -> ConnectionInfo {
    let settings = info.redis_settings().clone().set_protocol(protocol);
    info.clone().set_redis_settings(settings)
}

/// A connection of its own to the server at `info`.
async fn connect(
    info: &ConnectionInfo,
    config: &AsyncConnectionConfig,
) -> RedisResult<MultiplexedConnection> {
    Client::open(info.clone())?
        .get_multiplexed_async_connection_with_config(config)
        .await
}

/// Forgets the server that served the last reader's key if it is `at`,
/// which failed.
fn forget(last_owner: &Mutex<Option<ConnectionInfo>>, at: &ConnectionInfo) {
    let mut owner = lock(last_owner);
    if owner.as_ref().is_some_and(|o| o.addr() == at.addr()) {
        *owner = None;
    }
}

/// `seed`'s settings (credentials, database, protocol) at another address,
/// `host:port` as a redirect names it.
fn moved_to(seed: &ConnectionInfo, addr: &str) -> Option<ConnectionInfo> {
    let (host, port) = addr.rsplit_once(':')?;
    let port = port.parse().ok()?;
    Some(seed.clone().set_addr(ConnectionAddr::Tcp(
        host.trim_matches(['[', ']']).to_owned(),
        port,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cluster_url_names_every_seed_with_its_settings() {
        assert_eq!(
            cluster_seeds("redis+cluster://u:p@10.0.0.1:7000,10.0.0.2:7001/2?protocol=resp3"),
            Some(vec![
                "redis://u:p@10.0.0.1:7000/2?protocol=resp3".to_owned(),
                "redis://u:p@10.0.0.2:7001/2?protocol=resp3".to_owned(),
            ])
        );
        assert_eq!(
            cluster_seeds("redis+cluster://h:1"),
            Some(vec!["redis://h:1".to_owned()])
        );
        assert_eq!(cluster_seeds("redis://h:1/"), None);
        // No seed at all: refused by `Servers::cluster`.
        assert_eq!(cluster_seeds("redis+cluster://"), Some(vec![]));
        let e = Servers::open(&Target::Server("redis+cluster://,".into())).unwrap_err();
        assert!(e.is_config(), "{e:?}");
        assert!(matches!(
            Servers::open(&Target::Server("redis+cluster://127.0.0.1:7000,127.0.0.1:7001".into())),
            Ok(Servers::Cluster { ref seeds, .. }) if seeds.len() == 2
        ));
    }

    #[test]
    fn a_redirect_keeps_the_seeds_settings_at_its_address() {
        let seed = "redis://user:pw@10.0.0.1:7000/"
            .into_connection_info()
            .unwrap();
        let moved = moved_to(&seed, "10.0.0.2:7001").unwrap();
        assert_eq!(moved.addr(), &ConnectionAddr::Tcp("10.0.0.2".into(), 7001));
        let (m, s) = (moved.redis_settings(), seed.redis_settings());
        assert_eq!(
            (m.username(), m.password(), m.db()),
            (s.username(), s.password(), s.db())
        );
        assert_eq!(m.username(), Some("user"));
        assert!(moved_to(&seed, "nowhere").is_none());
        assert!(moved_to(&seed, "host:port").is_none());
        let v6 = moved_to(&seed, "::1:7002").unwrap();
        assert_eq!(v6.addr(), &ConnectionAddr::Tcp("::1".into(), 7002));
    }

    #[test]
    fn a_cluster_needs_tcp_seeds() {
        assert!(Servers::cluster(&[]).unwrap_err().is_config());
        assert!(
            Servers::cluster(&["redis+unix:///tmp/r.sock".into()])
                .unwrap_err()
                .is_config()
        );
        assert!(matches!(
            Servers::cluster(&["redis://127.0.0.1:7000/".into()]),
            Ok(Servers::Cluster { .. })
        ));
    }
}
