//! A RocketMQ name server and broker of the test's own (the Rust
//! `rocketmq-namesrv-rust` and `rocketmq-broker-rust`), on free loopback
//! ports with a temporary store, that the test can kill, restart on the same
//! store, and pause.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::redis_server::{free_port, signal};

/// Bytes of each server's log a failed test prints.
const LOG_TAIL: usize = 8 * 1024;

const NAMESRV: &str = "rocketmq-namesrv-rust";
const BROKER: &str = "rocketmq-broker-rust";
const BROKER_NAME: &str = "broker-a";
/// Logged once the broker has registered with the name server.
const BROKER_READY: &str = "started successfully";

/// A running name server and one broker, stopped on drop.
#[derive(Debug)]
pub struct RocketMqServer {
    namesrv_port: u16,
    broker_port: u16,
    dir: tempfile::TempDir,
    namesrv: Option<Child>,
    broker: Option<Child>,
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
        let dir = tempfile::tempdir().expect("temp dir for rocketmq");
        let namesrv_port = free_port();
        let broker_port = broker_port();
        let mut ha_port = free_port();
        while [namesrv_port, broker_port, broker_port - 2].contains(&ha_port) {
            ha_port = free_port();
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
        let store = run.join("store").display().to_string();
        std::fs::write(
            run.join("broker.toml"),
            format!(
                "[broker]\n\
                 brokerIp1 = \"127.0.0.1\"\n\
                 listenPort = {broker_port}\n\
                 namesrvAddr = \"127.0.0.1:{namesrv_port}\"\n\
                 storePathRootDir = {store:?}\n\
                 \n\
                 [broker.brokerIdentity]\n\
                 brokerName = \"{BROKER_NAME}\"\n\
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
                 timerWheelEnable = false\n\
                 haListenAddress = \"127.0.0.1\"\n\
                 haListenPort = {ha_port}\n"
            ),
        )
        .expect("broker config");
        let mut server = Self {
            namesrv_port,
            broker_port,
            dir,
            namesrv: None,
            broker: None,
        };
        server.spawn_namesrv();
        server.spawn_broker();
        server
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

    fn spawn_namesrv(&mut self) {
        let config = self.dir.path().join("namesrv.toml");
        let child = self.spawn(NAMESRV, &config, "warn", &self.log_path("namesrv"));
        self.namesrv = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.namesrv_port)).is_err() {
            if let Some(child) = self.namesrv.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "{NAMESRV} exited with {status}; log:\n{}",
                    self.log("namesrv")
                );
            }
            assert!(
                Instant::now() < deadline,
                "{NAMESRV} did not start in 10 s; log:\n{}",
                self.log("namesrv")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn spawn_broker(&mut self) {
        let log = self.log_path("broker");
        let seen = std::fs::read_to_string(&log).map_or(0, |s| s.len());
        let config = self.dir.path().join("broker.toml");
        // Info only from the broker's own startup: at info the store logs a
        // line every 125 ms.
        let child = self.spawn(BROKER, &config, "warn,rocketmq_broker=info", &log);
        self.broker = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        // The port opens a few ms before the broker registers its routes.
        while !self
            .log("broker")
            .get(seen..)
            .unwrap_or("")
            .contains(BROKER_READY)
        {
            if let Some(child) = self.broker.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                let log = self.log("broker");
                // The broker refuses to start on a disk over 75 % full (its
                // diskMaxUsedSpaceRatio), however small its own store.
                let hint = if log.contains("disk capacity requires reclaim") {
                    " (the disk is over the broker's 75 % limit: free some space)"
                } else {
                    ""
                };
                panic!("{BROKER} exited with {status}{hint}; log:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "{BROKER} did not start in 20 s; log:\n{}",
                self.log("broker")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
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

    /// The broker's address, `127.0.0.1:PORT`.
    pub fn broker_addr(&self) -> String {
        format!("127.0.0.1:{}", self.broker_port)
    }

    /// The broker's name (the first half of a partition name).
    pub fn broker_name(&self) -> &'static str {
        BROKER_NAME
    }

    /// `kill -9` the broker.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.broker.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the broker again on the same ports and store.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn_broker();
    }

    /// `kill -9` the broker, then starts it again on the same ports with an
    /// empty store: commit log, queues and topic configuration are gone, so
    /// queue offsets start again from 0.
    pub fn wipe(&mut self) {
        self.kill();
        let store = self.dir.path().join("store");
        if store.exists() {
            std::fs::remove_dir_all(&store).expect("remove the broker store");
        }
        self.spawn_broker();
    }

    /// SIGSTOP the broker.
    pub fn pause(&self) {
        signal("-STOP", self.broker_pid());
    }

    /// SIGCONT the broker.
    pub fn resume(&self) {
        signal("-CONT", self.broker_pid());
    }

    fn broker_pid(&self) -> u32 {
        self.broker.as_ref().expect("broker is running").id()
    }
}

impl Drop for RocketMqServer {
    fn drop(&mut self) {
        // A failed test's servers say what they saw (at warn: a failed
        // route registration, a store error), or the evidence goes with the
        // temporary directory.
        if std::thread::panicking() {
            for name in ["namesrv", "broker"] {
                let log = self.log(name);
                let from = (log.len().saturating_sub(LOG_TAIL)..log.len())
                    .find(|&i| log.is_char_boundary(i))
                    .unwrap_or(log.len());
                let tail = &log[from..];
                eprintln!("--- last of the {name} log ---\n{tail}");
            }
        }
        if let Some(child) = self.broker.as_ref() {
            signal("-CONT", child.id());
        }
        self.kill();
        if let Some(mut child) = self.namesrv.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
