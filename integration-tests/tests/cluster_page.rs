//! The cluster page (`GET /cache-sync/`) in a real browser: three nodes on
//! the embedded transport, one held back so that it lags, and Debian's
//! headless Chromium, driven through chromedriver, must show all three with
//! the lagging one flagged (by class and in words) and the others not.
//!
//! Needs the Debian packages `chromium` and `chromium-driver`
//! (`scripts/test` installs them). Without them the test fails, never
//! skips: a page nobody looked at in a browser is what it guards against.
//!
//! It also leaves a screenshot of the page in the cargo target directory
//! (`tmp/cluster-page.png`); `docs/cluster-page.png` is a copy of one.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cache_sync::{Node, Publisher, SyncedCache, transport::EmbeddedTransport};
use fantoccini::ClientBuilder;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

const EVERY: Duration = Duration::from_millis(100);

use cache_sync::transport::FaultyTransport;
use integration_tests::eventually;

/// A program the test needs, from Debian's packages: on the PATH or in
/// /usr/bin. Missing, the test fails and says what to install; with `CI`
/// set it says so too, since a CI image without it is misconfigured.
fn require(program: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(program))
        .find(|p| p.is_file());
    if let Some(p) = found {
        return p;
    }
    let why = if std::env::var_os("CI").is_some() {
        "CI is set, and the CI image lacks"
    } else {
        "this test needs a real browser, and this machine lacks"
    };
    panic!(
        "{why} `{program}`. Install Debian's packages `chromium` and `chromium-driver` \
         (apt-get install -y chromium chromium-driver; scripts/test does it when they \
         are missing). The test fails rather than skip, so a broken page cannot pass unseen."
    );
}

/// chromedriver, killed (and reaped) when the test ends, however it ends.
struct Chromedriver {
    child: Child,
    port: u16,
}

impl Chromedriver {
    fn start(program: &Path) -> Self {
        // A free loopback port: bound, read, released. Another process could
        // take it in between; then chromedriver fails to start and says so.
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        let child = Command::new(program)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {}: {e}", program.display()));
        let mut driver = Self { child, port };
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        for _ in 0..200 {
            if TcpStream::connect(addr).is_ok() {
                return driver;
            }
            if let Ok(Some(status)) = driver.child.try_wait() {
                panic!("chromedriver exited at start ({status}); its stderr is above");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("chromedriver did not listen on {addr} within 10 s");
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type Cache = SyncedCache<String, String>;

async fn start(id: &str, transport: FaultyTransport, cache: &Cache) -> Node {
    Node::builder(id, transport)
        .heartbeat_interval(EVERY)
        // Ready at once: no quarantine at start to wait out.
        .reorder_window(Duration::ZERO)
        .register(cache)
        .start()
        .await
        .expect("node starts")
}

/// Everything the check needs, read by one script in one document: the
/// page reloads itself every 2 s, and element handles found before a
/// reload go stale after it.
const READ_ROWS: &str = r#"
return Array.from(document.querySelectorAll('#nodes tbody tr')).map(tr => ({
    node: tr.dataset.node,
    classes: Array.from(tr.classList),
    text: tr.innerText,
    lagging_cells: Array.from(tr.querySelectorAll('td.cache.lagging')).map(td => td.innerText),
    visible: tr.getBoundingClientRect().height > 0,
}));
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_page_flags_the_lagging_node_in_chromium() {
    let chromium = require("chromium");
    let chromedriver = require("chromedriver");

    let shared = EmbeddedTransport::new();
    let level = FaultyTransport::new(shared.clone());
    let slow = FaultyTransport::new(shared.clone());
    let caches: Vec<Cache> = (0..3)
        .map(|_| SyncedCache::new("countries", moka::future::Cache::new(100)))
        .collect();
    let nodes = [
        start("node-a", level.clone(), &caches[0]).await,
        start("node-b", level.clone(), &caches[1]).await,
        start("node-c", slow.clone(), &caches[2]).await,
    ];
    let publisher = Publisher::new(shared.clone());
    let first = publisher
        .insert_versioned("countries", [("de", "Germany", Some(5))])
        .await
        .expect("publish v5");
    let acks = first
        .applied_by(&nodes[0].cluster(), Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    // node-c stops taking events in; the other two move on to v9.
    slow.stall(true);
    publisher
        .insert_versioned("countries", [("de", "Deutschland", Some(9))])
        .await
        .expect("publish v9");
    eventually("node-c lags by 4, the others are level", async || {
        let view = nodes[0].cluster().view();
        view.nodes.len() == 3
            && view
                .node("node-c")
                .is_some_and(|n| n.lagging && n.caches[0].lag == Some(4))
            && view.node("node-a").is_some_and(|n| !n.lagging)
            && view.node("node-b").is_some_and(|n| !n.lagging)
    })
    .await;
    let server = nodes[0]
        .serve_status("127.0.0.1:0")
        .await
        .expect("status server");
    let url = format!("http://{}/cache-sync/", server.local_addr());

    let driver = Chromedriver::start(&chromedriver);
    let mut caps = fantoccini::wd::Capabilities::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": chromium,
            // We run as root in a container: no sandbox. A fixed window
            // size makes the screenshot the same shape every time.
            "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1100,640"],
        }),
    );
    let browser = ClientBuilder::new(HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .expect("a chromedriver session");
    let checked = async {
        browser.goto(&url).await.expect("load the page");
        let title = browser.title().await.expect("title");
        assert!(title.contains("node-a"), "title: {title}");
        let rows = browser
            .execute(READ_ROWS, Vec::new())
            .await
            .expect("read the table");
        let rows = rows.as_array().expect("an array of rows").clone();
        let row = |id: &str| -> &Value {
            rows.iter()
                .find(|r| r["node"] == id)
                .unwrap_or_else(|| panic!("no row for {id}: {rows:#?}"))
        };
        assert_eq!(rows.len(), 3, "{rows:#?}");
        let lagging = |r: &Value| {
            r["classes"]
                .as_array()
                .is_some_and(|c| c.contains(&json!("lagging")))
        };
        for id in ["node-a", "node-b"] {
            let r = row(id);
            assert_eq!(r["visible"], true, "{r:#}");
            assert!(!lagging(r), "{id} is level but highlighted: {r:#}");
            assert_eq!(r["lagging_cells"], json!([]), "{r:#}");
            assert!(
                !r["text"].as_str().unwrap_or("").contains("lagging"),
                "{r:#}"
            );
        }
        let c = row("node-c");
        assert_eq!(c["visible"], true, "{c:#}");
        assert!(
            lagging(c),
            "node-c lags but its row is not highlighted: {c:#}"
        );
        let text = c["text"].as_str().unwrap_or("");
        assert!(text.contains("lagging"), "no marker in words: {c:#}");
        let cells = c["lagging_cells"].as_array().expect("cells");
        assert_eq!(cells.len(), 1, "{c:#}");
        let cell = cells[0].as_str().unwrap_or("");
        assert!(
            cell.contains("v5") && cell.contains("behind by 4"),
            "{cell}"
        );

        let png = browser.screenshot().await.expect("screenshot");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cluster-page.png");
        std::fs::write(&out, &png).expect("write the screenshot");
        eprintln!("screenshot of the cluster page: {}", out.display());
    };
    // Whatever happens above, end the browser session before the driver.
    let outcome = tokio::time::timeout(
        Duration::from_secs(60),
        futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(checked)),
    )
    .await;
    let _ = browser.close().await;
    drop(driver);
    slow.stall(false);
    server.shutdown().await.expect("status server shutdown");
    for node in &nodes {
        node.shutdown().await.expect("node shutdown");
    }
    match outcome {
        Err(_) => panic!("the browser check took over 60 s"),
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Ok(Ok(())) => {}
    }
}
