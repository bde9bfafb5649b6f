//! A minimal HTTP/1.1 GET for the examples that fetch their own endpoints,
//! so they need no HTTP client.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The status line and the body. `Connection: close` makes the server end
/// the response by closing, so reading to the end works.
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no end of headers in the response"))?;
    let status_line = head.lines().next().unwrap_or_default();
    Ok((status_line.to_owned(), body.to_owned()))
}
