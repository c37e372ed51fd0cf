//! A stand-in for ClickHouse's HTTP interface, for tests of what the client makes of
//! answers a real server sends only under faults: an exception after the first block of
//! a streamed answer, as ClickHouse 18.16 appends it (plain text after the rows, HTTP
//! 200 long sent, no exception header, no marker).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Request {
    /// The statement: the `query` parameter (an INSERT's), else the body.
    pub sql: String,
    /// Every URL parameter (settings and `wait_end_of_query` among them).
    pub params: BTreeMap<String, String>,
}

/// How the server answers a request.
pub enum Answer {
    /// 200 with these bytes (RowBinary rows; empty for a statement).
    Rows(Vec<u8>),
    /// 200 and these rows in a chunk, then the exception `text` and a newline in a chunk
    /// of its own, then the end of the body: what 18.16 sends when the query fails
    /// after its first block went out.
    BrokenOff { rows: Vec<u8>, text: String },
    /// An error status with the exception `text`: what a server sends when the query
    /// fails before anything of the answer went out (with `wait_end_of_query=1`, any
    /// failure).
    Error { status: u16, text: String },
}

/// A running stand-in: its URL, and every request it answered.
pub struct FakeServer {
    pub url: String,
    pub requests: Arc<Mutex<Vec<Request>>>,
}

impl FakeServer {
    /// The requests whose statement contains `needle`.
    pub fn requests_with(&self, needle: &str) -> Vec<Request> {
        self.requests.lock().unwrap().iter().filter(|r| r.sql.contains(needle)).cloned().collect()
    }
}

/// Serves on a free port of 127.0.0.1 until the test's runtime ends.
pub async fn serve(answer: impl Fn(&Request) -> Answer + Send + Sync + 'static) -> FakeServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let url = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(Mutex::new(Vec::new()));
    let answer = Arc::new(answer);
    let seen = requests.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let (answer, seen) = (answer.clone(), seen.clone());
            tokio::spawn(async move {
                let _ = connection(socket, &*answer, &seen).await;
            });
        }
    });
    FakeServer { url, requests }
}

/// One request on `socket`, answered, then the connection is closed.
async fn connection(
    socket: TcpStream,
    answer: &(dyn Fn(&Request) -> Answer + Send + Sync),
    seen: &Mutex<Vec<Request>>,
) -> std::io::Result<()> {
    let mut r = BufReader::new(socket);
    let mut line = String::new();
    r.read_line(&mut line).await?;
    let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let (mut length, mut chunked) = (0usize, false);
    loop {
        let mut h = String::new();
        r.read_line(&mut h).await?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (name, value) = h.split_once(':').unwrap_or((h, ""));
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => length = value.trim().parse().unwrap_or(0),
            "transfer-encoding" => chunked = value.to_ascii_lowercase().contains("chunked"),
            _ => {}
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).await?;
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
            if size == 0 {
                let mut end = String::new();
                while r.read_line(&mut end).await? > 0 && end != "\r\n" {
                    end.clear();
                }
                break;
            }
            let mut data = vec![0; size + 2];
            r.read_exact(&mut data).await?;
            body.extend_from_slice(&data[..size]);
        }
    } else {
        body.resize(length, 0);
        r.read_exact(&mut body).await?;
    }
    let params: BTreeMap<String, String> = url::Url::parse(&format!("http://x{target}"))
        .map(|u| u.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect())
        .unwrap_or_default();
    let sql = params.get("query").cloned().unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
    let request = Request { sql, params };
    let reply = answer(&request);
    seen.lock().unwrap().push(request);
    let mut socket = r.into_inner();
    let chunk = |data: &[u8]| [format!("{:x}\r\n", data.len()).into_bytes(), data.to_vec(), b"\r\n".to_vec()].concat();
    match reply {
        Answer::Rows(rows) => {
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                rows.len()
            );
            socket.write_all(head.as_bytes()).await?;
            socket.write_all(&rows).await?;
        }
        Answer::BrokenOff { rows, text } => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\
                        Connection: close\r\n\r\n";
            socket.write_all(head.as_bytes()).await?;
            socket.write_all(&chunk(&rows)).await?;
            socket.flush().await?;
            // The failure comes later than the first block, in a write of its own.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            socket.write_all(&chunk(format!("{text}\n").as_bytes())).await?;
            socket.write_all(b"0\r\n\r\n").await?;
        }
        Answer::Error { status, text } => {
            let body = format!("{text}\n");
            let head = format!(
                "HTTP/1.1 {status} Internal Server Error\r\nContent-Type: text/plain; charset=UTF-8\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            socket.write_all(head.as_bytes()).await?;
            socket.write_all(body.as_bytes()).await?;
        }
    }
    socket.flush().await?;
    socket.shutdown().await
}

/// What 18.16 appends for a query that ran out of time (`max_execution_time`) after its
/// first block, its elapsed time given to as many digits as make the text and its newline
/// a multiple of `row_size` bytes: every byte of it then decodes as rows of that size
/// (one answer in `row_size` is so; the others fail to decode instead).
pub fn timeout_18_16(row_size: usize) -> String {
    let mut elapsed = String::from("600.0");
    loop {
        let text = format!(
            "Code: 159, e.displayText() = DB::Exception: Timeout exceeded: elapsed {elapsed} seconds, maximum: 600, \
             e.what() = DB::Exception"
        );
        if (text.len() + 1) % row_size == 0 {
            return text;
        }
        elapsed.push('1');
    }
}
