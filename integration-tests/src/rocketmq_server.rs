//! A RocketMQ name server and one broker or more of the test's own (the
//! Rust `rocketmq-namesrv-rust` and `rocketmq-broker-rust`), on free loopback
//! ports with a temporary store each, that the test can kill, restart on the
//! same store, wipe, and pause, one broker at a time.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::process::{ServerProcess, says_port_taken, start_on_free_ports};
use crate::redis_server::free_port;

/// Bytes of each server's log a failed test prints.
const LOG_TAIL: usize = 8 * 1024;

const NAMESRV: &str = "rocketmq-namesrv-rust";
const BROKER: &str = "rocketmq-broker-rust";
/// Broker names, in start order: `broker-a`, `broker-b`, ….
const BROKER_NAMES: [&str; 4] = ["broker-a", "broker-b", "broker-c", "broker-d"];
/// Logged once the broker has registered with the name server.
const BROKER_READY: &str = "started successfully";
/// The broker measures the whole disk its store is on, not its own store,
/// and by default refuses to start when that disk is over 75 % used. A test
/// broker's store is a few MiB; what fills a shared disk is build
/// directories (CI builds a fresh clone beside a developer's), so the limits
/// are raised to the top of their range: the broker still refuses at 96 %,
/// which says "free some space" instead of failing later in odd ways.
/// The three must rise in this order (the broker checks it).
const DISK_MAX_USED_PERCENT: u8 = 96;
const DISK_CLEAN_FORCIBLY_PERCENT: u8 = 97;
const DISK_WARNING_PERCENT: u8 = 98;

/// A running name server and its brokers, stopped on drop.
#[derive(Debug)]
pub struct RocketMqServer {
    namesrv_port: u16,
    dir: tempfile::TempDir,
    namesrv: ServerProcess,
    brokers: Vec<Broker>,
}

/// One master broker, of its own name, ports, store and log.
#[derive(Debug)]
struct Broker {
    port: u16,
    process: ServerProcess,
}

/// Broker `i`'s file names: the first keeps the names of the days of one
/// broker (`broker.toml`, `store`, `broker.log`).
fn broker_file(i: usize, what: &str) -> String {
    match (i, what) {
        (0, "store") => "store".into(),
        (0, _) => format!("broker.{what}"),
        (_, "store") => format!("store-{i}"),
        (_, _) => format!("broker-{i}.{what}"),
    }
}

fn missing(binary: &str) -> String {
    format!(
        "{binary} is not on PATH nor in $HOME/.cargo/bin. Install it with \
         `cargo install rocketmq-namesrv rocketmq-broker`; ./scripts/test installs it when it is missing"
    )
}

/// The binary on PATH, else in `$HOME/.cargo/bin`.
fn find(binary: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(binary))
        .find(|p| p.is_file());
    let in_cargo = || {
        std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".cargo/bin").join(binary))
            .filter(|p| p.is_file())
    };
    on_path
        .or_else(in_cargo)
        .unwrap_or_else(|| panic!("{}", missing(binary)))
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// A listen port whose fast listener (port - 2) is free too.
fn broker_port() -> u16 {
    for _ in 0..100 {
        let port = free_port();
        if port > 1026 && port_is_free(port - 2) {
            return port;
        }
    }
    panic!("no free port pair for the broker");
}

impl RocketMqServer {
    /// Starts a name server and a broker (64 MiB commit log, no message index).
    pub fn start() -> Self {
        Self::start_with_brokers(1)
    }

    /// Starts a name server and `n` master brokers of different names
    /// (`broker-a`, `broker-b`, …; at most four) in one cluster, each with
    /// a store of its own.
    pub fn start_with_brokers(n: usize) -> Self {
        assert!((1..=BROKER_NAMES.len()).contains(&n), "1 to 4 brokers");
        start_on_free_ports("rocketmq", || Self::start_once(n))
    }

    /// One try at [`start`](Self::start); `Err` when a port was taken.
    fn start_once(n: usize) -> Result<Self, String> {
        let dir = tempfile::tempdir().expect("temp dir for rocketmq");
        let namesrv_port = free_port();
        let mut taken = vec![namesrv_port];
        let mut ports = Vec::new();
        for _ in 0..n {
            let mut port = broker_port();
            while taken.contains(&port) || taken.contains(&(port - 2)) {
                port = broker_port();
            }
            let mut ha_port = free_port();
            while taken.contains(&ha_port) || [port, port - 2].contains(&ha_port) {
                ha_port = free_port();
            }
            taken.extend([port, port - 2, ha_port]);
            ports.push((port, ha_port));
        }
        let run = dir.path();
        let namesrv_home = run.join("namesrv");
        std::fs::create_dir_all(&namesrv_home).expect("namesrv dir");
        std::fs::write(
            run.join("namesrv.toml"),
            format!(
                "listenPort = {namesrv_port}\n\
                 bindAddress = \"127.0.0.1\"\n\
                 rocketmqHome = {home:?}\n\
                 kvConfigPath = {kv:?}\n\
                 configStorePath = {cfg:?}\n",
                home = namesrv_home.display().to_string(),
                kv = namesrv_home.join("kvConfig.json").display().to_string(),
                cfg = namesrv_home
                    .join("namesrv.properties")
                    .display()
                    .to_string(),
            ),
        )
        .expect("namesrv config");
        for (i, &(broker_port, ha_port)) in ports.iter().enumerate() {
            let name = BROKER_NAMES[i];
            let store = run.join(broker_file(i, "store")).display().to_string();
            std::fs::write(
                run.join(broker_file(i, "toml")),
                format!(
                    "[broker]\n\
                 brokerIp1 = \"127.0.0.1\"\n\
                 listenPort = {broker_port}\n\
                 namesrvAddr = \"127.0.0.1:{namesrv_port}\"\n\
                 storePathRootDir = {store:?}\n\
                 \n\
                 [broker.brokerIdentity]\n\
                 brokerName = \"{name}\"\n\
                 brokerClusterName = \"DefaultCluster\"\n\
                 brokerId = 0\n\
                 \n\
                 [broker.brokerServerConfig]\n\
                 bindAddress = \"127.0.0.1\"\n\
                 \n\
                 [store]\n\
                 storePathRootDir = {store:?}\n\
                 mappedFileSizeCommitLog = 67108864\n\
                 mappedFileSizeConsumeQueue = 600000\n\
                 messageIndexEnable = false\n\
                 diskMaxUsedSpaceRatio = {DISK_MAX_USED_PERCENT}\n\
                 diskSpaceCleanForciblyRatio = {DISK_CLEAN_FORCIBLY_PERCENT}\n\
                 diskSpaceWarningLevelRatio = {DISK_WARNING_PERCENT}\n\
                 timerWheelEnable = false\n\
                 haListenAddress = \"127.0.0.1\"\n\
                 haListenPort = {ha_port}\n"
                ),
            )
            .expect("broker config");
        }
        let mut server = Self {
            namesrv_port,
            dir,
            namesrv: ServerProcess::default(),
            brokers: ports
                .iter()
                .map(|&(port, _)| Broker {
                    port,
                    process: ServerProcess::default(),
                })
                .collect(),
        };
        server.spawn_namesrv()?;
        for i in 0..n {
            server.spawn_broker(i)?;
        }
        server.wait_registered();
        // The broker registered with whatever answers on the name server's
        // port: that must be this name server, still running.
        if let Some(status) = server.namesrv.exited() {
            return Err(format!(
                "{NAMESRV} exited with {status} (port {namesrv_port} taken?)"
            ));
        }
        Ok(server)
    }

    /// Waits until the name server has every broker in its routes. A
    /// broker logs its start once the name server answered its
    /// registration, but with two, a client asking at once was seen to get
    /// only the first.
    fn wait_registered(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        for (i, b) in self.brokers.iter().enumerate() {
            let line = format!(
                "broker={}, id=0, addr=127.0.0.1:{}",
                BROKER_NAMES[i], b.port
            );
            while !self.log("namesrv").contains(&line) {
                assert!(
                    Instant::now() < deadline,
                    "the name server did not register {} in 10 s; its log:\n{}",
                    BROKER_NAMES[i],
                    self.log("namesrv")
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    fn spawn(&self, binary: &str, config: &Path, filter: &str, log: &Path) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("log file");
        Command::new(find(binary))
            .arg("-c")
            .arg(config)
            .args(["--log-filter", filter])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {binary}: {e}"))
    }

    fn spawn_namesrv(&mut self) -> Result<(), String> {
        let config = self.dir.path().join("namesrv.toml");
        // Info from the route table only: its "New broker registered" lines
        // say when a broker is in the routes clients are given.
        let child = self.spawn(
            NAMESRV,
            &config,
            "warn,rocketmq_namesrv::route::route_info_manager=info",
            &self.log_path("namesrv"),
        );
        self.namesrv.set(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.namesrv_port)).is_err() {
            if let Some(status) = self.namesrv.exited() {
                let log = self.log("namesrv");
                // What it says when its port is taken.
                if log.contains("Remoting server exited") || says_port_taken(&log) {
                    return Err(format!(
                        "{NAMESRV} exited with {status}: port {} taken",
                        self.namesrv_port
                    ));
                }
                panic!("{NAMESRV} exited with {status}; log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "{NAMESRV} did not start in 10 s; log:\n{}",
                self.log("namesrv")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Starts broker `i`; `Err` when its ports were taken.
    fn spawn_broker(&mut self, i: usize) -> Result<(), String> {
        let log_name = broker_file(i, "log");
        let log_name = log_name.trim_end_matches(".log").to_owned();
        let log = self.log_path(&log_name);
        let seen = std::fs::read_to_string(&log).map_or(0, |s| s.len());
        let config = self.dir.path().join(broker_file(i, "toml"));
        // Info only from the broker's own startup: at info the store logs a
        // line every 125 ms.
        let child = self.spawn(BROKER, &config, "warn,rocketmq_broker=info", &log);
        self.brokers[i].process.set(child);
        let broker_port = self.brokers[i].port;
        let deadline = Instant::now() + Duration::from_secs(20);
        // The port opens a few ms before the broker registers its routes.
        while !self
            .log("broker")
            .get(seen..)
            .unwrap_or("")
            .contains(BROKER_READY)
        {
            if let Some(status) = self.brokers[i].process.exited() {
                let log = self.log(&log_name);
                // What it says when a listen port is taken, in this run's
                // part of the log (a restart appends to it).
                let this_run = log.get(seen..).unwrap_or("");
                if this_run.contains("could not be started") || says_port_taken(this_run) {
                    return Err(format!(
                        "{BROKER} exited with {status}: a port of {} taken",
                        broker_port
                    ));
                }
                // The broker refuses to start on a disk over its limit,
                // however small its own store.
                let hint = if log.contains("disk capacity requires reclaim") {
                    format!(
                        " (the disk is over the broker's {DISK_MAX_USED_PERCENT} % limit: free some space)"
                    )
                } else {
                    String::new()
                };
                panic!("{BROKER} exited with {status}{hint}; log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "{BROKER} did not start in 20 s; log:\n{}",
                self.log(&log_name)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// A log so far: `"namesrv"` or `"broker"`.
    pub fn log(&self, name: &str) -> String {
        std::fs::read(self.log_path(name))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The name server's address, `127.0.0.1:PORT`.
    pub fn namesrv_addr(&self) -> String {
        format!("127.0.0.1:{}", self.namesrv_port)
    }

    /// The (first) broker's address, `127.0.0.1:PORT`.
    pub fn broker_addr(&self) -> String {
        self.broker_addr_of(0)
    }

    /// Broker `i`'s address.
    pub fn broker_addr_of(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.brokers[i].port)
    }

    /// The (first) broker's name (the first half of a partition name).
    pub fn broker_name(&self) -> &'static str {
        BROKER_NAMES[0]
    }

    /// Broker `i`'s name.
    pub fn broker_name_of(&self, i: usize) -> &'static str {
        BROKER_NAMES[i]
    }

    /// How many brokers run (or were started).
    pub fn brokers(&self) -> usize {
        self.brokers.len()
    }

    /// `kill -9` the (first) broker.
    pub fn kill(&mut self) {
        self.kill_broker(0);
    }

    /// `kill -9` broker `i`.
    pub fn kill_broker(&mut self, i: usize) {
        self.brokers[i].process.kill();
    }

    /// Starts the (first) broker again on the same ports and store.
    pub fn restart(&mut self) {
        self.restart_broker(0);
    }

    /// Starts broker `i` again on the same ports and store.
    pub fn restart_broker(&mut self, i: usize) {
        self.kill_broker(i);
        self.spawn_broker(i)
            .unwrap_or_else(|e| panic!("restart: {e}"));
    }

    /// `kill -9` the (first) broker, then starts it again on the same ports
    /// with an empty store: commit log, queues and topic configuration are
    /// gone, so queue offsets start again from 0.
    pub fn wipe(&mut self) {
        self.wipe_broker(0);
    }

    /// [`wipe`](Self::wipe) for broker `i`.
    pub fn wipe_broker(&mut self, i: usize) {
        self.kill_broker(i);
        let store = self.dir.path().join(broker_file(i, "store"));
        if store.exists() {
            std::fs::remove_dir_all(&store).expect("remove the broker store");
        }
        self.spawn_broker(i).unwrap_or_else(|e| panic!("wipe: {e}"));
    }

    /// SIGSTOP the (first) broker.
    pub fn pause(&self) {
        self.brokers[0].process.pause();
    }

    /// SIGCONT the (first) broker.
    pub fn resume(&self) {
        self.brokers[0].process.resume();
    }
}

impl Drop for RocketMqServer {
    fn drop(&mut self) {
        // A failed test's servers say what they saw (at warn: a failed
        // route registration, a store error), or the evidence goes with the
        // temporary directory.
        if std::thread::panicking() {
            let names = (0..self.brokers.len())
                .map(|i| broker_file(i, "log").trim_end_matches(".log").to_owned());
            for name in std::iter::once("namesrv".to_owned()).chain(names) {
                let log = self.log(&name);
                let from = (log.len().saturating_sub(LOG_TAIL)..log.len())
                    .find(|&i| log.is_char_boundary(i))
                    .unwrap_or(log.len());
                let tail = &log[from..];
                eprintln!("--- last of the {name} log ---\n{tail}");
            }
        }
        // Before the fields drop: the temporary directory goes first.
        for b in &mut self.brokers {
            b.process.kill();
        }
        self.namesrv.kill();
    }
}
