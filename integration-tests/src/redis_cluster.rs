//! A Redis Cluster of the test's own: three masters with a replica each, six
//! `redis-server` processes on free loopback ports (each with a cluster bus
//! port of its own), joined by `redis-cli --cluster create`, with a node
//! timeout of one second so that a failover takes a few. A test can kill,
//! pause, resume or restart any server, wait for a master's replica to
//! take over, fail a master over by hand (`CLUSTER FAILOVER`), and move a
//! slot to another master while clients use it.
//!
//! Servers are addressed by their index in the cluster, which stays theirs
//! across restarts and changes of role.
//!
//! [`RedisCluster::start_with_server_links`] puts a proxy in front of each
//! server's port and bus port, and has each server dial its peers from a
//! loopback address of its own: a server can then be cut from its peers
//! while clients still reach it ([`ServerLinks::isolate`]), the split
//! brain of a master partitioned away from the majority.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::proxy::Proxy;
use crate::redis_server::{RedisServer, Reply};

/// How long a master may be unreachable before its replica takes over: a
/// failover then takes two to three seconds (the timeout, then an election
/// delayed by up to a second).
pub const NODE_TIMEOUT: Duration = Duration::from_millis(1000);
/// Masters, each with one replica.
const MASTERS: usize = 3;
/// The longest any change of the cluster's shape is waited for.
const SETTLE: Duration = Duration::from_secs(30);

const MISSING: &str = "redis-cli is not on PATH. Install it (Debian: `apt-get install redis-tools`, \
                       which redis-server depends on); ./scripts/test installs it when it is missing";

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub master: bool,
    /// Flagged `fail` or `fail?` by the node that answered.
    pub failing: bool,
    /// The master it replicates, for a replica.
    pub master_id: Option<String>,
    /// Slot ranges it serves, inclusive.
    pub slots: Vec<(u16, u16)>,
}

impl ClusterNode {
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(lo, hi)| (lo..=hi).contains(&slot))
    }
}

/// A running cluster, its servers stopped on drop.
#[derive(Debug)]
pub struct RedisCluster {
    servers: Vec<RedisServer>,
    /// The port each server tells clients and peers to use: its own, or its
    /// proxy's.
    announced: Vec<u16>,
    paused: Vec<bool>,
}

/// The links to the servers of a cluster started with
/// [`RedisCluster::start_with_server_links`].
#[derive(Debug)]
pub struct ServerLinks {
    /// Per server: the proxy in front of its port, then of its bus port.
    proxies: Vec<[Proxy; 2]>,
    /// Per server: the loopback address it dials its peers from (its bus
    /// links and, as a replica, its replication link).
    sources: Vec<IpAddr>,
}

impl ServerLinks {
    /// Cuts server `i` from every other server, both ways, closing nothing
    /// (as across a partition): no bus link and no replication link between
    /// them moves a byte. Every client still reaches every server, `i`
    /// included.
    pub fn isolate(&self, i: usize) {
        for (j, proxies) in self.proxies.iter().enumerate() {
            let cut: Vec<IpAddr> = if j == i {
                (0..self.sources.len())
                    .filter(|&k| k != i)
                    .map(|k| self.sources[k])
                    .collect()
            } else {
                vec![self.sources[i]]
            };
            for proxy in proxies {
                proxy.cut_sources(&cut);
            }
        }
    }

    /// Restores every link and delivers what was held.
    pub fn heal(&self) {
        for proxy in self.proxies.iter().flatten() {
            proxy.heal();
        }
    }
}

impl RedisCluster {
    /// Starts six servers and makes them a cluster of three masters with a
    /// replica each; returns once every server sees the cluster whole and
    /// every replica is in sync with its master.
    pub fn start() -> Self {
        let servers: Vec<RedisServer> = (0..MASTERS * 2)
            .map(|_| RedisServer::start_cluster_node(millis(NODE_TIMEOUT)))
            .collect();
        let announced = servers.iter().map(RedisServer::port).collect();
        Self::create(servers, announced)
    }

    /// [`RedisCluster::start`], with every link to a server, from clients
    /// and from its peers, through a proxy in front of it, and each server
    /// dialling from a loopback address of its own (`bind-source-addr`,
    /// 127.0.0.(101 + its index)), so that [`ServerLinks::isolate`] can cut
    /// servers from one another and not from clients. The servers announce
    /// the proxies' ports, so clients that follow the cluster's topology
    /// (`CLUSTER SLOTS`, `MOVED`) go through them too.
    ///
    /// Blocking calls run off the runtime: the proxies need it to move the
    /// bytes the cluster's creation waits for. A test that waits on the
    /// cluster itself later (`wait_whole`, `wait_for_new_master`) does so
    /// from `spawn_blocking` or a multi-threaded runtime, for the same
    /// reason.
    pub async fn start_with_server_links() -> (Self, ServerLinks) {
        let mut servers = tokio::task::spawn_blocking(|| {
            (0..MASTERS * 2)
                .map(|_| RedisServer::start_cluster_node(millis(NODE_TIMEOUT)))
                .collect::<Vec<_>>()
        })
        .await
        .expect("start the servers");
        let mut proxies = Vec::new();
        let mut sources = Vec::new();
        let mut announced = Vec::new();
        for (i, server) in servers.iter_mut().enumerate() {
            let bus_port = server
                .cluster_bus_port()
                .expect("a cluster node's bus port");
            let client = Proxy::start(server.addr()).await;
            let bus = Proxy::start(SocketAddr::from(([127, 0, 0, 1], bus_port))).await;
            let source = IpAddr::from([127, 0, 0, 101 + u8::try_from(i).expect("few servers")]);
            server.configure("cluster-announce-ip", "127.0.0.1");
            server.configure("cluster-announce-port", &client.addr().port().to_string());
            server.configure("cluster-announce-bus-port", &bus.addr().port().to_string());
            server.configure("bind-source-addr", &source.to_string());
            announced.push(client.addr().port());
            sources.push(source);
            proxies.push([client, bus]);
        }
        let cluster = tokio::task::spawn_blocking(move || Self::create(servers, announced))
            .await
            .expect("create the cluster");
        (cluster, ServerLinks { proxies, sources })
    }

    /// Joins `servers` into a cluster (each reached at its `announced`
    /// port) and waits until it is whole.
    fn create(servers: Vec<RedisServer>, announced: Vec<u16>) -> Self {
        let addrs: Vec<String> = announced
            .iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        let out = match Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!("{MISSING}"),
            Err(e) => panic!("cannot run redis-cli: {e}"),
        };
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster {
            paused: vec![false; servers.len()],
            servers,
            announced,
        };
        cluster.wait_whole();
        cluster
    }

    /// Waits until every live server says the cluster is ok, knows every
    /// server, sees every slot served, and every replica's link to its
    /// master is up.
    pub fn wait_whole(&self) {
        self.wait_until("the cluster whole and in sync", || {
            self.live().all(|i| {
                let info = self.text(i, &["CLUSTER", "INFO"]).unwrap_or_default();
                let replication = self.text(i, &["INFO", "replication"]).unwrap_or_default();
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{}", self.servers.len()))
                    && info.contains("cluster_slots_assigned:16384")
                    && info.contains("cluster_slots_fail:0")
                    && info.contains("cluster_slots_pfail:0")
                    && (replication.contains("role:master")
                        || replication.contains("master_link_status:up"))
            })
        });
    }

    /// How many servers the cluster has (live or not).
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Every server's URL, `redis://127.0.0.1:PORT/` at the port it
    /// announces: the seeds a client is given.
    pub fn urls(&self) -> Vec<String> {
        self.announced
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}/"))
            .collect()
    }

    /// One server.
    pub fn server(&self, i: usize) -> &RedisServer {
        &self.servers[i]
    }

    /// The slot a key hashes to (`CLUSTER KEYSLOT`, asked of a live
    /// server).
    pub fn slot(&self, key: &str) -> u16 {
        let i = self.any_live();
        match self.servers[i].query(&["CLUSTER", "KEYSLOT", key]) {
            Ok(Reply::Int(slot)) => u16::try_from(slot).expect("a slot fits in u16"),
            other => panic!("CLUSTER KEYSLOT answered {other:?}"),
        }
    }

    /// The cluster as server `i` sees it.
    pub fn nodes_seen_by(&self, i: usize) -> Vec<ClusterNode> {
        let text = self
            .text(i, &["CLUSTER", "NODES"])
            .unwrap_or_else(|e| panic!("CLUSTER NODES on server {i}: {e}"));
        text.lines().filter_map(parse_node).collect()
    }

    /// The server that serves `slot`, as a live server sees it.
    pub fn master_of(&self, slot: u16) -> usize {
        let i = self.any_live();
        self.master_of_seen_by(i, slot)
            .unwrap_or_else(|| panic!("no master serves slot {slot}: {:?}", self.nodes_seen_by(i)))
    }

    /// The masters that serve slots, as a live server sees them.
    pub fn masters(&self) -> Vec<usize> {
        self.nodes_seen_by(self.any_live())
            .iter()
            .filter(|n| n.master && !n.failing && !n.slots.is_empty())
            .map(|n| self.index_of(n.port))
            .collect()
    }

    /// The replica of the master at `master`, as a live server sees it.
    pub fn replica_of(&self, master: usize) -> usize {
        let nodes = self.nodes_seen_by(self.any_live());
        let id = self.id(master);
        let port = nodes
            .iter()
            .find(|n| !n.master && n.master_id.as_deref() == Some(id.as_str()))
            .unwrap_or_else(|| panic!("server {master} has no replica: {nodes:?}"))
            .port;
        self.index_of(port)
    }

    /// `kill -9` of one server.
    pub fn kill(&mut self, i: usize) {
        self.servers[i].kill();
        self.paused[i] = false;
    }

    /// SIGSTOP: the server holds its connections and answers nothing, on
    /// the cluster bus neither, so its peers fail it over after the node
    /// timeout.
    pub fn pause(&mut self, i: usize) {
        self.servers[i].pause();
        self.paused[i] = true;
    }

    /// SIGCONT: a master that was failed over meanwhile comes back stale,
    /// learns of the newer epoch and turns into a replica.
    pub fn resume(&mut self, i: usize) {
        self.servers[i].resume();
        self.paused[i] = false;
    }

    /// Starts a killed server again on its port and data: it rejoins with
    /// its `nodes.conf`.
    pub fn restart(&mut self, i: usize) {
        self.servers[i].restart();
        self.paused[i] = false;
    }

    /// Waits until a master other than `old` serves `slot`, as the live
    /// servers see it, and the cluster is ok again; returns it.
    pub fn wait_for_new_master(&self, slot: u16, old: usize) -> usize {
        let mut found = None;
        self.wait_until(&format!("a new master for slot {slot}"), || {
            let views: Vec<Option<usize>> = self
                .live()
                .filter(|&i| i != old)
                .map(|i| {
                    let info = self.text(i, &["CLUSTER", "INFO"]).unwrap_or_default();
                    info.contains("cluster_state:ok")
                        .then(|| self.master_of_seen_by(i, slot))
                        .flatten()
                })
                .collect();
            match views.first() {
                Some(Some(m)) if *m != old && views.iter().all(|v| *v == Some(*m)) => {
                    found = Some(*m);
                    true
                }
                _ => false,
            }
        });
        found.expect("found")
    }

    /// `CLUSTER FAILOVER` on the replica at `replica`: it and its master
    /// swap roles with no write lost (the master stops taking writes until
    /// the replica has them all). Returns once every live server sees it as
    /// master.
    pub fn failover(&self, replica: usize) {
        self.promote(replica, &["CLUSTER", "FAILOVER"]);
    }

    /// `CLUSTER FAILOVER TAKEOVER` on the replica at `replica`: it makes
    /// itself master without asking its master or the others, with what
    /// it has; writes its master took and had not sent it are lost, as
    /// after an automatic failover of a master that died ahead of its
    /// replica. Returns once every live server sees it as master.
    pub fn take_over(&self, replica: usize) {
        self.promote(replica, &["CLUSTER", "FAILOVER", "TAKEOVER"]);
    }

    fn promote(&self, replica: usize, command: &[&str]) {
        match self.servers[replica].query(command) {
            Ok(Reply::Status(s)) if s == "OK" => {}
            other => panic!("{command:?} on server {replica} answered {other:?}"),
        }
        let port = self.announced[replica];
        self.wait_until(&format!("server {replica} a master"), || {
            self.live().all(|i| {
                self.nodes_seen_by(i)
                    .iter()
                    .any(|n| n.port == port && n.master && !n.slots.is_empty())
            })
        });
    }

    /// Moves `slot` to the master at `to`, keys and all, while clients may
    /// use it: the source answers ASK for keys already moved, and MOVED
    /// once the slot is the target's (`CLUSTER SETSLOT ... IMPORTING /
    /// MIGRATING`, `MIGRATE` in batches, then `SETSLOT ... NODE` on every
    /// master, the target first).
    pub fn move_slot(&self, slot: u16, to: usize) {
        let from = self.master_of(slot);
        assert_ne!(from, to, "slot {slot} is served by server {to} already");
        let (from_id, to_id) = (self.id(from), self.id(to));
        let slot_s = slot.to_string();
        let ok = |i: usize, args: &[&str]| match self.servers[i].query(args) {
            Ok(Reply::Status(s)) if s == "OK" || s == "NOKEY" => {}
            other => panic!("{args:?} on server {i} answered {other:?}"),
        };
        ok(to, &["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", &from_id]);
        ok(from, &["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", &to_id]);
        let to_port = self.servers[to].port().to_string();
        loop {
            let keys = match self.servers[from].query(&["CLUSTER", "GETKEYSINSLOT", &slot_s, "100"])
            {
                Ok(r @ Reply::Array(_)) => r
                    .items()
                    .iter()
                    .filter_map(Reply::text)
                    .collect::<Vec<String>>(),
                other => panic!("CLUSTER GETKEYSINSLOT answered {other:?}"),
            };
            if keys.is_empty() {
                break;
            }
            let mut args = vec!["MIGRATE", "127.0.0.1", &to_port, "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            ok(from, &args);
        }
        let masters: Vec<usize> = self
            .nodes_seen_by(to)
            .iter()
            .filter(|n| n.master && !n.failing)
            .map(|n| self.index_of(n.port))
            .collect();
        ok(to, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &to_id]);
        ok(from, &["CLUSTER", "SETSLOT", &slot_s, "NODE", &to_id]);
        for m in masters {
            if m != to && m != from && self.is_live(m) {
                // `to`'s view can lag: a master it still lists may have
                // turned replica since (a stale master after a pause), and
                // a replica follows its master's slots without being told.
                let args = ["CLUSTER", "SETSLOT", &slot_s, "NODE", &to_id];
                match self.servers[m].query(&args) {
                    Ok(Reply::Status(s)) if s == "OK" => {}
                    Ok(Reply::Error(e)) if e.contains("only with masters") => {}
                    other => panic!("{args:?} on server {m} answered {other:?}"),
                }
            }
        }
        self.wait_until(&format!("slot {slot} on server {to} everywhere"), || {
            self.live()
                .all(|i| self.master_of_seen_by(i, slot) == Some(to))
        });
    }

    fn master_of_seen_by(&self, i: usize, slot: u16) -> Option<usize> {
        self.nodes_seen_by(i)
            .iter()
            .find(|n| n.master && !n.failing && n.serves(slot))
            .map(|n| self.index_of(n.port))
    }

    /// Server `i`'s cluster node id.
    pub fn id(&self, i: usize) -> String {
        self.text(i, &["CLUSTER", "MYID"])
            .unwrap_or_else(|e| panic!("CLUSTER MYID on server {i}: {e}"))
    }

    fn index_of(&self, port: u16) -> usize {
        self.announced
            .iter()
            .position(|&p| p == port)
            .unwrap_or_else(|| panic!("no server of this cluster on port {port}"))
    }

    /// Whether server `i` runs and is not paused: it can be asked.
    fn is_live(&self, i: usize) -> bool {
        !self.paused[i] && self.servers[i].command(&["PING"]).is_ok()
    }

    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.servers.len()).filter(|&i| self.is_live(i))
    }

    fn any_live(&self) -> usize {
        self.live()
            .next()
            .expect("no server of the cluster is live")
    }

    fn text(&self, i: usize, args: &[&str]) -> std::io::Result<String> {
        match self.servers[i].query(args)? {
            Reply::Error(e) => Err(std::io::Error::other(e)),
            r => r
                .text()
                .ok_or_else(|| std::io::Error::other(format!("{args:?} answered {r:?}"))),
        }
    }

    fn wait_until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + SETTLE;
        while !done() {
            if Instant::now() >= deadline {
                let seen: Vec<String> = self
                    .live()
                    .map(|i| self.text(i, &["CLUSTER", "NODES"]).unwrap_or_default())
                    .collect();
                panic!(
                    "waited {SETTLE:?} for {what}; the live servers see:\n{}",
                    seen.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).expect("a short duration")
}

/// One line of `CLUSTER NODES`: `<id> <ip:port@bus[,hostname]> <flags>
/// <master> <ping-sent> <pong-recv> <epoch> <link> <slot>...`, a slot being
/// `N`, `N-M`, or a migration in brackets (skipped).
fn parse_node(line: &str) -> Option<ClusterNode> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 8 {
        return None;
    }
    let port = fields[1]
        .split('@')
        .next()?
        .rsplit(':')
        .next()?
        .parse()
        .ok()?;
    let flags: Vec<&str> = fields[2].split(',').collect();
    let slots = fields[8..]
        .iter()
        .filter(|s| !s.starts_with('['))
        .filter_map(|s| match s.split_once('-') {
            Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
            None => s.parse().ok().map(|n| (n, n)),
        })
        .collect();
    Some(ClusterNode {
        id: fields[0].to_owned(),
        port,
        master: flags.contains(&"master"),
        failing: flags.contains(&"fail") || flags.contains(&"fail?"),
        master_id: (fields[3] != "-").then(|| fields[3].to_owned()),
        slots,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_nodes_lines_parse() {
        let m = parse_node(
            "07c3 127.0.0.1:30004@31004,host myself,master - 0 1426238316232 3 connected 10923-16383 7 [8->-e7d1]",
        )
        .unwrap();
        assert_eq!(m.port, 30004);
        assert!(m.master && !m.failing && m.master_id.is_none());
        assert_eq!(m.slots, [(10923, 16383), (7, 7)]);
        assert!(m.serves(7) && m.serves(16383) && !m.serves(8));
        let r = parse_node("e7d1 127.0.0.1:30005@31005 slave,fail? 07c3 0 1 3 connected").unwrap();
        assert!(!r.master && r.failing);
        assert_eq!(r.master_id.as_deref(), Some("07c3"));
        assert!(parse_node("").is_none());
    }
}
