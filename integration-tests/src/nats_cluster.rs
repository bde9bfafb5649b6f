//! A JetStream cluster of three `nats-server` processes of the test's own,
//! routed to each other on loopback ports, each with its own store and
//! monitoring port. A test can kill, pause, resume or restart any server,
//! find the server that leads a stream (from `/jsz`) or holds client
//! connections (from `/connz`), and wait for a new leader.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::nats_server::NatsServer;
use crate::redis_server::free_port;

/// Servers in the cluster: the fewest for a quorum that outlives one.
const SERVERS: usize = 3;

/// The longest wait for the cluster to settle after a change.
const SETTLE: Duration = Duration::from_secs(30);

/// The route proxies of a cluster started with
/// [`NatsCluster::start_with_route_proxies`].
#[derive(Debug)]
pub struct RouteLinks {
    /// (dialing server, dialed server, the proxy between them).
    pairs: Vec<(usize, usize, crate::proxy::Proxy)>,
}

impl RouteLinks {
    /// Cuts server `i` from both its peers, both ways, closing nothing (as
    /// across a partition); its clients still reach it.
    pub fn isolate(&self, i: usize) {
        for (a, b, proxy) in &self.pairs {
            if *a == i || *b == i {
                proxy.blackhole();
            }
        }
    }

    /// Restores every route, delivering what was held.
    pub fn heal(&self) {
        for (_, _, proxy) in &self.pairs {
            proxy.heal();
        }
    }
}

/// A running three-server JetStream cluster, stopped on drop.
#[derive(Debug)]
pub struct NatsCluster {
    servers: Vec<NatsServer>,
    /// Each server's monitoring port.
    monitors: Vec<u16>,
    /// Servers killed or paused: not asked anything.
    down: Vec<bool>,
}

impl NatsCluster {
    /// Starts three servers routed to each other; returns once every one
    /// sees the same JetStream meta leader.
    pub fn start() -> Self {
        let mut last = String::new();
        for _ in 0..5 {
            match Self::try_start() {
                Ok(cluster) => {
                    cluster.wait_for_meta_leader();
                    return cluster;
                }
                // A port taken between choosing and binding: other ports.
                Err(e) => last = e,
            }
        }
        panic!("a NATS cluster did not start in 5 attempts: {last}");
    }

    fn try_start() -> Result<Self, String> {
        let routes: Vec<u16> = (0..SERVERS).map(|_| free_port()).collect();
        let direct = |_: usize, j: usize| format!("nats://127.0.0.1:{}", routes[j]);
        Self::try_start_routed(&routes, direct, None)
    }

    /// Starts three servers whose routes each pass through a fault proxy
    /// of their own, one per ordered pair of servers (server `i` dials
    /// server `j` through its own proxy), so that one server can be cut
    /// from its peers while the other two stay linked
    /// ([`RouteLinks::isolate`]). Each server advertises a closed port, so
    /// no route is opened around the proxies from what the servers gossip.
    pub async fn start_with_route_proxies() -> (Self, RouteLinks) {
        let mut last = String::new();
        for _ in 0..5 {
            let routes: Vec<u16> = (0..SERVERS).map(|_| free_port()).collect();
            let mut pairs = Vec::new();
            for i in 0..SERVERS {
                for j in (0..SERVERS).filter(|&j| j != i) {
                    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], routes[j]));
                    pairs.push((i, j, crate::proxy::Proxy::start(upstream).await));
                }
            }
            let via = |i: usize, j: usize| {
                let (_, _, proxy) = pairs
                    .iter()
                    .find(|(a, b, _)| *a == i && *b == j)
                    .expect("a proxy per ordered pair");
                format!("nats://{}", proxy.addr())
            };
            let closed = free_port();
            let started = tokio::task::block_in_place(|| {
                Self::try_start_routed(&routes, via, Some(closed))
                    .inspect(Self::wait_for_meta_leader)
            });
            match started {
                Ok(cluster) => return (cluster, RouteLinks { pairs }),
                Err(e) => last = e,
            }
        }
        panic!("a NATS cluster behind route proxies did not start in 5 attempts: {last}");
    }

    /// Starts the servers with route ports `routes`; server `i` dials
    /// server `j` at `route(i, j)`, and advertises `advertise` to its
    /// peers if given.
    fn try_start_routed(
        routes: &[u16],
        route: impl Fn(usize, usize) -> String,
        advertise: Option<u16>,
    ) -> Result<Self, String> {
        let clients: Vec<u16> = (0..SERVERS).map(|_| free_port()).collect();
        let monitors: Vec<u16> = (0..SERVERS).map(|_| free_port()).collect();
        let name = format!("cache-sync-{}-{}", std::process::id(), clients[0]);
        let mut servers = Vec::new();
        for i in 0..SERVERS {
            let others: Vec<String> = (0..SERVERS)
                .filter(|&j| j != i)
                .map(|j| route(i, j))
                .collect();
            let mut extra = vec![
                "--cluster".to_owned(),
                format!("nats://127.0.0.1:{}", routes[i]),
                "--cluster_name".to_owned(),
                name.clone(),
                "--routes".to_owned(),
                others.join(","),
                "-m".to_owned(),
                monitors[i].to_string(),
            ];
            if let Some(port) = advertise {
                extra.push("--cluster_advertise".to_owned());
                extra.push(format!("127.0.0.1:{port}"));
            }
            servers.push(NatsServer::start_with(clients[i], extra)?);
        }
        Ok(Self {
            servers,
            monitors,
            down: vec![false; SERVERS],
        })
    }

    /// Every server's URL, comma-separated: what a client is given.
    pub fn urls(&self) -> String {
        self.servers
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How many servers the cluster has.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// `kill -9` of one server.
    pub fn kill(&mut self, i: usize) {
        self.servers[i].kill();
        self.down[i] = true;
    }

    /// Starts a killed server again on its ports and store.
    pub fn restart(&mut self, i: usize) {
        self.servers[i].restart();
        self.down[i] = false;
    }

    /// SIGSTOP: its routes and clients time out.
    pub fn pause(&mut self, i: usize) {
        self.servers[i].pause();
        self.down[i] = true;
    }

    /// SIGCONT: a stale leader comes back and learns of the newer term.
    pub fn resume(&mut self, i: usize) {
        self.servers[i].resume();
        self.down[i] = false;
    }

    /// The server that leads `stream`, as a live server reports it.
    pub fn stream_leader(&self, stream: &str) -> Option<usize> {
        self.live()
            .find_map(|i| self.stream_leader_seen_by(i, stream))
    }

    /// The sequence number of the last message in `stream` as server `i`
    /// holds it.
    pub fn last_seq_on(&self, i: usize, stream: &str) -> Option<u64> {
        let jsz = self.get(i, "/jsz?accounts=true&streams=true")?;
        stream_detail(&jsz, stream)?
            .pointer("/state/last_seq")?
            .as_u64()
    }

    /// The leader of `stream` as server `i` reports it.
    fn stream_leader_seen_by(&self, i: usize, stream: &str) -> Option<usize> {
        let jsz = self.get(i, "/jsz?accounts=true&streams=true")?;
        let leader = stream_detail(&jsz, stream)?
            .pointer("/cluster/leader")?
            .as_str()?
            .to_owned();
        self.index_of(&leader)
    }

    /// The servers that host consumers of `stream` (an ordered consumer
    /// is a one-replica consumer: it lives on one server), as a live server
    /// reports them.
    pub fn consumer_hosts(&self, stream: &str) -> Vec<usize> {
        for i in self.live() {
            let Some(jsz) = self.get(i, "/jsz?accounts=true&streams=true&consumers=true") else {
                continue;
            };
            let Some(consumers) = stream_detail(&jsz, stream)
                .and_then(|s| s.get("consumer_detail"))
                .and_then(Value::as_array)
            else {
                continue;
            };
            return consumers
                .iter()
                .filter_map(|c| c.pointer("/cluster/leader")?.as_str())
                .filter_map(|name| self.index_of(name))
                .collect();
        }
        Vec::new()
    }

    /// Server `i`'s client URL.
    pub fn url_of(&self, i: usize) -> String {
        self.servers[i].url()
    }

    /// Waits until a server other than `old` leads `stream`, every replica
    /// of it on a live server is current, and returns the leader.
    pub fn wait_for_new_leader(&self, stream: &str, old: usize) -> usize {
        let mut found = None;
        self.wait_until(&format!("a new leader of {stream}"), || {
            // As the others see it: `old`, if it runs cut off from them,
            // names itself until it steps down.
            found = self
                .live()
                .filter(|&i| i != old)
                .find_map(|i| self.stream_leader_seen_by(i, stream))
                .filter(|&l| l != old);
            found.is_some()
        });
        found.expect("found")
    }

    /// Waits until the leader of `stream` reports every other replica
    /// current (only the leader keeps that account; a follower's is stale).
    pub fn wait_in_sync(&self, stream: &str) {
        self.wait_until(&format!("{stream} in sync"), || {
            let Some(leader) = self.stream_leader(stream) else {
                return false;
            };
            if self.down[leader] {
                return false;
            }
            let Some(jsz) = self.get(leader, "/jsz?accounts=true&streams=true") else {
                return false;
            };
            let Some(detail) = stream_detail(&jsz, stream) else {
                return false;
            };
            let leads = detail.pointer("/cluster/leader").and_then(Value::as_str)
                == Some(self.servers[leader].server_name());
            let replicas = detail
                .pointer("/cluster/replicas")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            leads
                && replicas.len() + 1 == self.servers.len()
                && replicas
                    .iter()
                    .all(|r| r.get("current").and_then(Value::as_bool) == Some(true))
        });
    }

    /// The live server with the most client connections.
    pub fn busiest(&self) -> usize {
        self.live()
            .max_by_key(|&i| {
                self.get(i, "/connz")
                    .and_then(|c| c.get("num_connections")?.as_u64())
                    .unwrap_or(0)
            })
            .expect("no live server")
    }

    /// Whether server `i` leads the JetStream meta group, as it reports.
    pub fn is_meta_leader(&self, i: usize) -> bool {
        let name = self.servers[i].server_name();
        self.get(i, "/jsz")
            .and_then(|j| Some(j.pointer("/meta_cluster/leader")?.as_str()? == name))
            .unwrap_or(false)
    }

    fn wait_for_meta_leader(&self) {
        self.wait_until("a JetStream meta leader", || {
            let leaders: Vec<Option<String>> = self
                .live()
                .map(|i| {
                    self.get(i, "/jsz")
                        .and_then(|j| Some(j.pointer("/meta_cluster/leader")?.as_str()?.to_owned()))
                })
                .collect();
            leaders.first().is_some_and(Option::is_some) && leaders.windows(2).all(|w| w[0] == w[1])
        });
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.servers.iter().position(|s| s.server_name() == name)
    }

    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.servers.len()).filter(|&i| !self.down[i])
    }

    /// A monitoring endpoint's JSON, or `None` if the server did not answer.
    fn get(&self, i: usize, path: &str) -> Option<Value> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.monitors[i])).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let (_, body) = response.split_once("\r\n\r\n")?;
        serde_json::from_str(body).ok()
    }

    fn wait_until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + SETTLE;
        while !done() {
            if Instant::now() >= deadline {
                let seen: Vec<String> = self
                    .live()
                    .map(|i| {
                        let jsz = self.get(i, "/jsz?accounts=true&streams=true");
                        format!("server {i}: {jsz:?}")
                    })
                    .collect();
                panic!(
                    "waited {SETTLE:?} for {what}; the live servers report:\n{}",
                    seen.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `stream`'s entry in a `/jsz?accounts=true&streams=true` report.
fn stream_detail<'a>(jsz: &'a Value, stream: &str) -> Option<&'a Value> {
    jsz.get("account_details")?
        .as_array()?
        .iter()
        .filter_map(|a| a.get("stream_detail")?.as_array())
        .flatten()
        .find(|s| s.get("name").and_then(Value::as_str) == Some(stream))
}
