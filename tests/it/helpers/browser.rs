//! The status page in a real browser: headless Chromium through `scripts/chromium`
//! (which installs it when missing; a failure fails the test), and a reader for the
//! page's DOM contract (`data-figure`, `data-partition`, `data-field`, `data-value`;
//! see the comment at the top of `assets/status.html`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Runs `scripts/chromium ARGS` off the test's runtime; its stdout, or a failed test.
pub async fn chromium(args: Vec<String>) -> String {
    let mut cmd = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/chromium"));
    cmd.args(&args);
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run scripts/chromium")).await.unwrap();
    assert!(
        out.status.success(),
        "scripts/chromium {args:?} failed (Chromium is required, never skipped):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 DOM")
}

/// The page at `url` as Chromium renders it, once its first polls have run.
pub async fn page(url: &str) -> Page {
    Page::parse(&chromium(vec!["--dump-dom".into(), url.into()]).await)
}

/// Captures `url` at `width` x `height` into `path` and returns the PNG's size.
pub async fn screenshot(url: &str, path: &Path, width: u32, height: u32) -> (u32, u32) {
    chromium(vec![format!("--screenshot={}", path.display()), format!("--window-size={width},{height}"), url.into()])
        .await;
    let png = std::fs::read(path).unwrap_or_else(|e| panic!("no screenshot at {}: {e}", path.display()));
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
    // The IHDR chunk comes first: width and height, big-endian, at bytes 16..24.
    let be = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
    (be(&png[16..20]), be(&png[20..24]))
}

/// One start tag of the DOM with its attributes (entities decoded).
#[derive(Debug, Clone)]
pub struct Element {
    pub tag: String,
    pub attrs: BTreeMap<String, String>,
}

impl Element {
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attrs.get(name).map(String::as_str)
    }

    /// `data-value` read as the JSON it is.
    pub fn value(&self) -> serde_json::Value {
        let raw = self.attr("data-value").unwrap_or_else(|| panic!("{self:?} has no data-value"));
        serde_json::from_str(raw).unwrap_or_else(|e| panic!("data-value {raw:?} is not JSON: {e}"))
    }
}

/// A dumped page: its HTML, and its elements in document order.
pub struct Page {
    pub html: String,
    pub elements: Vec<Element>,
}

impl Page {
    /// Reads the start tags of `html`, without its comments (the page's documents its
    /// DOM contract in one, tags included) and the text of scripts and styles (where a
    /// `<` is code, not a tag).
    pub fn parse(html: &str) -> Page {
        let html = without_comments(html);
        let mut elements = Vec::new();
        let mut rest = html.as_str();
        while let Some(i) = rest.find('<') {
            rest = &rest[i + 1..];
            let name_len = rest.find(|c: char| !c.is_ascii_alphanumeric()).unwrap_or(rest.len());
            if name_len == 0 {
                continue; // `</…>`, `<!…>` or a stray `<`
            }
            let tag = rest[..name_len].to_ascii_lowercase();
            let end = rest.find('>').unwrap_or(rest.len());
            let attrs = attributes(&rest[name_len..end]);
            rest = &rest[end.min(rest.len())..];
            if tag == "script" || tag == "style" {
                let close = format!("</{tag}");
                rest = rest.find(&close).map_or("", |j| &rest[j..]);
            }
            elements.push(Element { tag, attrs });
        }
        Page { html, elements }
    }

    /// Elements with `name="value"`.
    pub fn all(&self, name: &str, value: &str) -> Vec<&Element> {
        self.elements.iter().filter(|e| e.attr(name) == Some(value)).collect()
    }

    /// The one element with `data-figure="name"` (and no `data-reason`).
    pub fn figure(&self, name: &str) -> &Element {
        let found: Vec<_> =
            self.all("data-figure", name).into_iter().filter(|e| e.attr("data-reason").is_none()).collect();
        assert_eq!(found.len(), 1, "data-figure={name:?}: {found:?}");
        found[0]
    }

    /// Per `<tr data-partition>`, its `<td data-field>` cells by field.
    pub fn partitions(&self) -> BTreeMap<i64, BTreeMap<String, Element>> {
        let mut rows: BTreeMap<i64, BTreeMap<String, Element>> = BTreeMap::new();
        let mut current = None;
        for e in &self.elements {
            if let Some(p) = e.attr("data-partition") {
                let p = p.parse().expect("numeric data-partition");
                rows.insert(p, BTreeMap::new());
                current = Some(p);
            } else if let (Some(field), Some(p), "td") = (e.attr("data-field"), current, e.tag.as_str()) {
                rows.get_mut(&p).unwrap().insert(field.to_string(), e.clone());
            }
        }
        rows
    }

    /// The page's connection line (state and text), for failure messages.
    pub fn connection(&self) -> String {
        let at = self.html.find("data-figure=\"connection\"").unwrap_or(0);
        self.html[at..].chars().take(200).collect()
    }

    /// How many times the page rendered a status (`<body data-renders>`).
    pub fn renders(&self) -> u64 {
        let body = self.elements.iter().find(|e| e.tag == "body").expect("a body");
        body.attr("data-renders").and_then(|n| n.parse().ok()).unwrap_or(0)
    }
}

/// `name="value"` pairs of a start tag, values with their entities decoded.
fn attributes(mut s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    loop {
        s = s.trim_start_matches(|c: char| c.is_whitespace() || c == '/');
        let name_len = s.find(|c: char| c == '=' || c.is_whitespace() || c == '/').unwrap_or(s.len());
        if name_len == 0 {
            return out;
        }
        let name = s[..name_len].to_string();
        s = &s[name_len..];
        let value = match s.strip_prefix("=\"") {
            Some(quoted) => {
                let end = quoted.find('"').unwrap_or(quoted.len());
                s = quoted.get(end + 1..).unwrap_or("");
                decode(&quoted[..end])
            }
            None => String::new(),
        };
        out.insert(name, value);
    }
}

fn without_comments(mut html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    while let Some(start) = html.find("<!--") {
        out.push_str(&html[..start]);
        html = html[start..].find("-->").map_or("", |end| &html[start + end + 3..]);
    }
    out.push_str(html);
    out
}

fn decode(s: &str) -> String {
    s.replace("&quot;", "\"").replace("&#39;", "'").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
}
