#!/usr/bin/env python3
"""The checks of scripts/docs-check, after `mdbook build docs` (Python 3 stdlib only).

Docs that cannot go stale: README.md, ARCHITECTURE.md, docs/ (the guide's sources and
the files it includes) and the comments of the code (`//` in src/ and tests/, `--` in
sql/ and claim.lua, `#` in scripts/ and .ci/run) are read for

  link      every relative link resolves to a file, and its #anchor to a heading or an
            id there: in the markdown as GitHub renders it, and in the built guide
            (docs/book, every href and src of every page). A link to this repository by
            URL (https://github.com/clickagg/clickagg/blob/main/PATH#ANCHOR, as the
            alerts' runbook URLs are) is checked the same way. Other http(s) links
            cannot be fetched here: they are counted, not checked.
  path      every repository path quoted (src/…, tests/…, scripts/…, sql/…, deploy/…,
            docs/…; a file name with its folder, `dedup/decide.rs`; a bare source file
            name, `claim.lua`) exists.
  name      every code name quoted in backticks — `module::item`, `Type::method`,
            `fn_name()`, a snake_case or UPPER_SNAKE identifier — is a name the
            project's code uses (src/, tests/, sql/, scripts/, assets/, deploy/, with
            comments left out, so a comment cannot vouch for itself), or is on the
            short allow-list below (names of other projects).
  setting   every settings key quoted (`kafka.session_timeout`,
            CLICKAGG__KAFKA__TOPIC) is a key of the guide's configuration reference
            (which a unit test checks against the code: src/config/reference.rs).
  section   every section a comment or a page cites by name — README, "What counts";
            guide, "Sealed hours"; docs/DESIGN.md §5 — is a heading of that document.
  map       ARCHITECTURE.md names every module of src/ (each file and folder of src/
            and of its folders) and every migration of sql/.

Prints what it found by kind and exits non-zero if anything is wrong.
"""

import html.parser
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO_URL = "https://github.com/clickagg/clickagg/blob/main/"
BOOK_SRC = ROOT / "docs/src"
BOOK_OUT = ROOT / "docs/book"
REFERENCE = BOOK_SRC / "configure/reference.md"
SECTIONS = ("kafka", "source", "redis", "dedup", "clickhouse", "pipeline", "validation",
            "dead_letter", "seal", "http", "log")

# Names of other projects that the docs quote as code but clickagg's code does not
# spell: each is real where it lives, and says why it is quoted.
OTHER_PROJECTS = {
    # ClickHouse settings and server config the docs explain but clickagg never sends.
    "insert_quorum_parallel": "ClickHouse: why 18.16 serialises quorum inserts",
    "max_partitions_per_insert_block": "ClickHouse: the 100-month split of a flush",
    "internal_replication": "ClickHouse remote_servers setting of the cluster stack",
    "distributed_ddl": "ClickHouse server config section of the cluster stack",
    "remote_servers": "ClickHouse server config section naming clusters",
    "https_port": "ClickHouse server config: why chdb serves no HTTPS",
    # ClickHouse error names quoted beside their codes.
    "TOO_MANY_PARTS": "ClickHouse error 252",
    "KEEPER_EXCEPTION": "ClickHouse error 999",
    # Redis and Kafka server settings the docs ask an operator to set.
    "tls_auth_clients": "Redis tls-auth-clients",
    "mutations_sync": "ClickHouse setting: why the registries never ALTER",
    # librdkafka's own names.
    "rd_kafka_msg_max_wire_size": "librdkafka: how it sizes a message against message.max.bytes",
    # Process metrics that the metrics-process crate exports under its own names.
    "process_virtual_memory_bytes": "metrics-process",
    "process_max_fds": "metrics-process",
    "process_threads": "metrics-process",
}

# The dated log keeps the names a run used then (databases, other tools' counters):
# its links and paths are checked, its names are history.
NAMES_NOT_CHECKED = {"docs/BENCHMARKS.md"}

findings = defaultdict(list)
counts = Counter()


def rel(p):
    return str(Path(p).resolve().relative_to(ROOT))


def find(kind, where, what):
    findings[kind].append(f"{where}: {what}")


# ---------------------------------------------------------------- the files read

def md_files():
    files = [ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted(BOOK_SRC.rglob("*.md"))
    return [f for f in files if f.exists()]


def tracked(pattern_dirs, exts=None):
    """The files under the given folders of the repository (with these suffixes)."""
    out = []
    for d in pattern_dirs:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and (exts is None or p.suffix in exts):
                out.append(p)
    return out


def script_files():
    out = [p for p in tracked(["scripts"]) if p.suffix in ("", ".py", ".sh")]
    return out + [ROOT / ".ci/run"]


# ---------------------------------------------------------------- markdown

FENCE = re.compile(r"^(\s*)(```|~~~)")


def strip_fences(text):
    """The text with fenced code blocks blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def slug(heading):
    """GitHub's anchor of a heading (mdBook makes the same for these headings)."""
    t = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    t = re.sub(r"<[^>]+>", "", t)
    t = t.strip().lower()
    t = re.sub(r"[^\w\- ]", "", t)
    return t.replace(" ", "-")


_anchor_cache = {}


def md_anchors(path):
    path = Path(path)
    if path not in _anchor_cache:
        text = strip_fences(path.read_text(encoding="utf-8"))
        anchors, seen = set(), Counter()
        for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
            s = slug(h)
            anchors.add(s if seen[s] == 0 else f"{s}-{seen[s]}")
            seen[s] += 1
        anchors |= set(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", text))
        # What an {{#include}} brings in is part of the page.
        for inc in re.findall(r"\{\{#include\s+([^}\s]+)\s*\}\}", text):
            target = (path.parent / inc.split(":")[0]).resolve()
            if target.exists():
                anchors |= md_anchors(target)
        _anchor_cache[path] = anchors
    return _anchor_cache[path]


def md_headings(path):
    text = strip_fences(Path(path).read_text(encoding="utf-8"))
    hs = [re.sub(r"`", "", h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)]
    return [re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h) for h in hs]


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
AUTOLINK = re.compile(r"<(https?://[^>\s]+)>")


def check_target(where, base_dir, target):
    """One link's target, relative to base_dir (a markdown file's folder)."""
    if target.startswith(("mailto:",)):
        return
    if target.startswith(REPO_URL):
        counts["links by repository URL"] += 1
        path, _, anchor = target[len(REPO_URL):].partition("#")
        check_local(where, ROOT, path, anchor, target)
        return
    if re.match(r"^[a-z]+://", target):
        counts["external links (not fetched)"] += 1
        return
    counts["relative links"] += 1
    path, _, anchor = target.partition("#")
    check_local(where, base_dir, path, anchor, target)


def check_local(where, base_dir, path, anchor, target):
    p = (base_dir / path).resolve() if path else None
    if p is not None:
        if not p.exists():
            find("link", where, f"{target}: no such file")
            return
    if anchor:
        counts["anchors"] += 1
        doc = p if p is not None else None
        if doc is None or doc.is_dir() or doc.suffix != ".md":
            if doc is not None:
                find("link", where, f"{target}: an anchor into a file that is not markdown")
            return
        if anchor not in md_anchors(doc):
            find("link", where, f"{target}: {rel(doc)} has no heading or id #{anchor}")


def check_md_links(path):
    text = path.read_text(encoding="utf-8")
    lines = strip_fences(text).split("\n")
    for n, line in enumerate(lines, 1):
        line_wo_code = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line_wo_code):
            check_target(f"{rel(path)}:{n}", path.parent, m.group(1))
        for m in AUTOLINK.finditer(line_wo_code):
            check_target(f"{rel(path)}:{n}", path.parent, m.group(1))
    for n, line in enumerate(text.split("\n"), 1):
        for inc in re.findall(r"\{\{#include\s+([^}\s]+)\s*\}\}", line):
            counts["includes"] += 1
            if not (path.parent / inc.split(":")[0]).exists():
                find("link", f"{rel(path)}:{n}", f"{{{{#include {inc}}}}}: no such file")


# ---------------------------------------------------------------- the built guide

class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.refs = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("id", "name"):
            if a.get(k) and (k == "id" or tag == "a"):
                self.ids.add(a[k])
        for k in ("href", "src"):
            if a.get(k):
                self.refs.append((tag, a[k]))


def check_book():
    if not BOOK_OUT.is_dir():
        find("link", "docs/book", "the guide is not built (mdbook build docs)")
        return
    pages = {}
    # 404.html is served for any missing path: its links are absolute from the site's
    # root (mdBook's site-url), not relative to the file.
    for f in sorted(x for x in BOOK_OUT.rglob("*.html") if x.name != "404.html"):
        p = Page()
        p.feed(f.read_text(encoding="utf-8"))
        pages[f.resolve()] = p
    counts["built pages"] = len(pages)
    for f, page in pages.items():
        where = rel(f)
        for tag, ref in page.refs:
            if ref.startswith(("mailto:", "javascript:", "data:")) or ref == "#":
                continue
            if re.match(r"^[a-z]+://", ref) or ref.startswith("//"):
                if ref.startswith(REPO_URL):
                    counts["book: links by repository URL"] += 1
                    path, _, anchor = ref[len(REPO_URL):].partition("#")
                    check_local(where, ROOT, path, anchor, ref)
                continue
            counts["book: relative links"] += 1
            path, _, anchor = ref.partition("#")
            path = path.split("?")[0]
            target = (f.parent / path).resolve() if path else f
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                find("link", where, f"{ref}: no such file in the built guide")
                continue
            if anchor and target.suffix == ".html":
                counts["book: anchors"] += 1
                ids = pages[target].ids if target in pages else set()
                if anchor not in ids:
                    find("link", where, f"{ref}: {rel(target)} has no id #{anchor}")


# ---------------------------------------------------------------- comments

def rust_comments(text):
    """(line, text) of each `//` comment of Rust source, strings and chars skipped."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((line, re.sub(r"^//[/!]?", "", text[i:j])))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i)
            j = n if j < 0 else j + 2
            body = text[i:j]
            out.append((line, body))
            line += body.count("\n")
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and not re.match(r"\w", text[i - 1] if i else " "):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            line += text[i:end].count("\n")
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            line += text[i:j].count("\n")
            i = j + 1
        elif c == "'" and re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12]):
            i += len(re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12]).group(0))
        else:
            i += 1
    return out


def rust_code(text):
    """Rust source with its comments removed (strings kept)."""
    spans = []
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
        spans.append(m.span())
    # Keep a `//` that sits inside a string ("http://…"): a rough test, good enough for
    # collecting identifiers.
    out, last = [], 0
    for a, b in spans:
        before = text[text.rfind("\n", 0, a) + 1:a]
        if before.count('"') % 2 == 1:
            continue
        out.append(text[last:a])
        last = b
    out.append(text[last:])
    return "".join(out)


def hash_comments(text):
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if n == 1 and line.startswith("#!"):
            continue
        m = re.match(r"^\s*#(.*)$", line) or re.search(r"\s#\s(.*)$", line)
        if m:
            out.append((n, m.group(1)))
    return out


def dash_comments(text):
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        m = re.search(r"--(.*)$", line)
        if m and not re.search(r"['\"][^'\"]*--", line[:m.end()]):
            out.append((n, m.group(1)))
    return out


def comment_blocks(path):
    """Runs of consecutive comment lines of a code file, as (first line, joined text)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".rs":
        lines = rust_comments(text)
    elif path.suffix in (".sql", ".lua"):
        lines = dash_comments(text)
    else:
        lines = hash_comments(text)
    blocks, cur, last = [], [], None
    for n, t in lines:
        if cur and n != last + 1:
            blocks.append((cur[0][0], "\n".join(x for _, x in cur)))
            cur = []
        cur.append((n, t))
        last = n + t.count("\n")
    if cur:
        blocks.append((cur[0][0], "\n".join(x for _, x in cur)))
    return blocks


# ---------------------------------------------------------------- the code's names

def code_identifiers():
    names = set()
    for p in tracked(["src", "tests"], {".rs"}):
        names |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", rust_code(p.read_text(encoding="utf-8"))))
    other = tracked(["src", "sql", "assets", "deploy"], {".lua", ".sql", ".html", ".yml", ".yaml", ".tpl", ".json", ".toml", ".txt"})
    other += script_files() + [ROOT / f for f in ("Cargo.toml", "build.rs", "Dockerfile", "docker-compose.yml") if (ROOT / f).exists()]
    for p in other:
        text = p.read_text(encoding="utf-8", errors="replace")
        if p.suffix in (".lua", ".sql"):
            text = re.sub(r"--[^\n]*", "", text)
        elif p.suffix not in (".html", ".json", ".tpl"):
            text = "\n".join(l for l in text.split("\n") if not l.lstrip().startswith("#"))
        names |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    # File and directory names are names a doc may quote as modules.
    for p in tracked(["src", "tests"]):
        names.add(p.stem)
        names |= set(p.relative_to(ROOT).parts)
    return names


def reference_keys():
    """The keys of the configuration reference: exact keys, and maps (`x.<key>`)."""
    keys, maps = set(), set()
    if not REFERENCE.exists():
        find("setting", rel(REFERENCE), "the configuration reference is missing")
        return keys, maps
    for line in REFERENCE.read_text(encoding="utf-8").split("\n"):
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        for k in re.findall(r"`([^`]+)`", first):
            if k.startswith("-") or " --" in k:
                continue
            if "<" in k:
                maps.add(k.split("<")[0].rstrip("."))
            else:
                keys.add(k)
    return keys, maps


# ---------------------------------------------------------------- paths and names

ALL_FILES = None


def all_files():
    global ALL_FILES
    if ALL_FILES is None:
        ALL_FILES = set()
        # Build output, service data (running services change it under the walk) and git's
        # own files are no sources.
        skip = {".git", "target", ".stack", "__pycache__", "docs/book"}
        for d, dirs, files in os.walk(ROOT, onerror=lambda e: None):
            r = os.path.relpath(d, ROOT)
            r = "" if r == "." else r + "/"
            dirs[:] = [x for x in dirs if x not in skip and r + x not in skip]
            ALL_FILES.update(r + x for x in dirs + files)
    return ALL_FILES


PATH = re.compile(r"(?<![\w./~-])((?:src|tests|scripts|sql|deploy|docs)/[\w./*{}<>-]*)")
SOURCE_EXT = r"(?:rs|lua|sql|py)"
FILE_NAME = re.compile(r"^(?:[\w-]+/)*[\w-]+\." + SOURCE_EXT + r"$|^(?:[\w-]+/)+[\w.-]+\.\w+$")


def path_exists(token):
    token = token.rstrip(".,:;)'\"")
    token = token.split("#")[0]
    if not token or token.endswith("/") and token.count("/") == 1 and token[:-1] in ("src", "tests", "scripts", "sql", "deploy", "docs"):
        return True, token
    if re.search(r"[*{<]", token):
        pattern = re.escape(token.rstrip("/"))
        pattern = re.sub(r"\\\*", r"[^/]*", pattern)
        pattern = re.sub(r"\\\{[^}]*\\\}|<[^>]*>", r"[^/]+", pattern)
        rx = re.compile("^" + pattern + "(/.*)?$")
        return any(rx.match(f) for f in all_files()), token
    t = token.rstrip("/")
    if t in all_files():
        return True, token
    # `sql/006` for sql/006_clickagg_clocks.sql: the beginning of a name, up to `_`.
    if not token.endswith("/") and "." not in t.split("/")[-1]:
        if any(f.startswith(t + "_") or f.startswith(t + ".") for f in all_files()):
            return True, token
    return False, token


def check_paths(where, text, only_quoted=False):
    for m in PATH.finditer(text):
        tok = m.group(1)
        if tok.rstrip(".,:;)") in ("src", "tests", "scripts", "sql", "deploy", "docs"):
            continue
        counts["paths"] += 1
        ok, tok = path_exists(tok)
        if not ok:
            find("path", where, f"{tok}: no such file or directory")


def check_file_name(where, span):
    """A quoted file name with a folder (`dedup/decide.rs`), or a bare source file."""
    if not FILE_NAME.match(span) or PATH.match(span) or re.search(r"[<{*]", span):
        return
    counts["file names"] += 1
    files = all_files()
    if "/" in span:
        if not any(f == span or f.endswith("/" + span) for f in files):
            find("path", where, f"{span}: no such file under any folder")
    elif not any(f.rsplit("/", 1)[-1] == span for f in files):
        find("path", where, f"{span}: no file of that name")


SNAKE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
UPPER = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
IDENT = re.compile(r"^[A-Za-z_]\w*$")
SETTING = re.compile(r"(?<![\w.$/-])(" + "|".join(SECTIONS) + r")\.([a-z_]+(?:\.[a-z_]+)*)(?![\w-]|\.\w)")
ENV = re.compile(r"\bCLICKAGG__([A-Z_]+?)__([A-Z0-9_]+?)(?:__([A-Z0-9_]+))?(_FILE)?\b")


def check_setting(where, key, keys, maps):
    counts["settings"] += 1
    if key in keys or any(key == m or key.startswith(m + ".") for m in maps):
        return
    if any(k.startswith(key + ".") for k in keys):  # a section or a table (`redis.sentinel`)
        return
    find("setting", where, f"`{key}` is not a key of the configuration reference")


def check_span(where, span, names, keys, maps):
    s = re.sub(r"\s*\n\s*", "", span) if "::\n" in span else span
    s = s.strip()
    if not s:
        return
    check_file_name(where, s)
    for m in SETTING.finditer(s):
        key = f"{m.group(1)}.{m.group(2)}"
        if re.search(r"\.(rs|lua|sql|md|py|toml|yml|json)$", key) or s[m.end():].startswith("("):
            continue
        # Four segments or more is another system's dotted name
        # (`log.message.timestamp.after.max.ms`), unless a map of ours holds it.
        if key.count(".") >= 3 and not any(key.startswith(mp + ".") for mp in maps):
            continue
        check_setting(where, key, keys, maps)
    for m in ENV.finditer(s):
        section, key, sub = m.group(1).lower(), m.group(2).lower(), m.group(3)
        full = f"{section}.{key}" + (f".{sub.lower()}" if sub else "")
        if section == "section" or key in ("key",):  # the documented pattern itself
            continue
        check_setting(where, full, keys, maps)
    if re.search(r"\s", s):
        return
    to_check = []
    core = re.sub(r"\{[^}]*\}$", "", s)  # a metric with its labels
    core = re.sub(r"<[^>]*>", "", core)  # generics
    if "::" in core and not core.startswith("::"):
        segs = [x for x in re.split(r"::", re.sub(r"\(.*\)$", "", core)) if x]
        if all(IDENT.match(x) for x in segs):
            to_check += [x for x in segs if x not in ("crate", "self", "super", "std", "core")]
    elif re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\(.*\)$", core) and "." not in core.split("(")[0]:
        to_check.append(core.split("(")[0])
    elif re.match(r"^[A-Za-z_][\w.]*\(", core):
        # a chain of calls: each name called
        to_check += re.findall(r"(?:^|\.)([A-Za-z_]\w*)\(", core)
    elif SNAKE.match(core) or UPPER.match(core):
        if not core.startswith("CLICKAGG__"):
            to_check.append(core)
    for name in to_check:
        counts["code names"] += 1
        if name in names or name in OTHER_PROJECTS:
            continue
        find("name", where, f"`{name}` (in `{s}`) is no name in src/, tests/ or the other code")


SECTION_REF = re.compile(
    r"(README(?:\.md)?|guide|ARCHITECTURE\.md|DESIGN\.md)[,:]?\s*\(?\s*\"([^\"]+)\"", re.S)
DESIGN_REF = re.compile(r"DESIGN\.md\s*((?:§\s*\d+(?:\s*(?:,|and)\s*)?)+)")


def check_sections(where, text, heads):
    for m in SECTION_REF.finditer(text):
        doc, name = m.group(1), re.sub(r"\s+", " ", m.group(2)).strip()
        counts["sections cited"] += 1
        want = heads["README" if doc.startswith("README") else doc]
        if not any(h.lower() == name.lower() or h.lower().startswith(name.lower()) for h in want):
            find("section", where, f'{doc}, "{name}": no such heading')
    for m in DESIGN_REF.finditer(text):
        for num in re.findall(r"\d+", m.group(1)):
            counts["sections cited"] += 1
            if not any(re.match(rf"{num}\.\s", h) for h in heads["DESIGN.md"]):
                find("section", where, f"docs/DESIGN.md §{num}: no such section")


KINDS = ("link", "path", "name", "setting", "section", "map")


def check_map():
    """ARCHITECTURE.md names each module of src/ and each migration of sql/."""
    arch = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    src = ROOT / "src"
    modules = [p for p in src.iterdir()] + [q for p in src.iterdir() if p.is_dir() for q in p.iterdir() if q.is_dir()]
    for p in sorted(modules):
        counts["modules mapped"] += 1
        r = rel(p)
        if p.is_dir():
            named = re.search(rf"(?<![\w-]){re.escape(p.name)}/", arch)
        elif p.suffix in (".rs", ".lua"):
            named = re.search(rf"(?<![\w-]){re.escape(p.name)}\b", arch) or re.search(rf"\b{re.escape(r)}\b", arch)
        else:
            continue
        if not named:
            find("map", "ARCHITECTURE.md", f"{r}{'/' if p.is_dir() else ''} is not named")
    for p in sorted((ROOT / "sql").glob("[0-9]*.sql")):
        counts["modules mapped"] += 1
        if not re.search(rf"(?<![\w.]){p.name.split('_')[0]}(?!\d)", arch):
            find("map", "ARCHITECTURE.md", f"{rel(p)} is not named")


def spans_of(text):
    """Inline code spans (one line break allowed inside), with their line offsets."""
    for m in re.finditer(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", text):
        yield text.count("\n", 0, m.start()), m.group(1)


def main():
    names = code_identifiers()
    keys, maps = reference_keys()
    heads = {
        "README": md_headings(ROOT / "README.md"),
        "guide": [h for p in sorted(BOOK_SRC.rglob("*.md")) for h in md_headings(p)] if BOOK_SRC.exists() else [],
        "ARCHITECTURE.md": md_headings(ROOT / "ARCHITECTURE.md"),
        "DESIGN.md": md_headings(ROOT / "docs/DESIGN.md"),
    }
    for f in md_files():
        check_md_links(f)
        text = f.read_text(encoding="utf-8")
        for n, line in enumerate(text.split("\n"), 1):
            check_paths(f"{rel(f)}:{n}", re.sub(r"\]\([^)]*\)", "]", line))
        prose = strip_fences(text)
        for off, span in spans_of(prose):
            if rel(f) not in NAMES_NOT_CHECKED:
                check_span(f"{rel(f)}:{off + 1}", span, names, keys, maps)
        check_sections(rel(f), prose, heads)
    check_book()
    check_map()
    code = tracked(["src", "tests"], {".rs", ".lua"}) + tracked(["sql"], {".sql"}) + script_files()
    for p in code:
        for line, block in comment_blocks(p):
            counts["comment blocks"] += 1
            where = f"{rel(p)}:{line}"
            check_paths(where, block)
            for off, span in spans_of(block):
                check_span(f"{rel(p)}:{line + off}", span, names, keys, maps)
            check_sections(where, block, heads)

    print("docs-check: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    total = 0
    for kind in KINDS:
        for f in findings.get(kind, []):
            print(f"docs-check: {kind}: {f}", file=sys.stderr)
        total += len(findings.get(kind, []))
    summary = ", ".join(f"{len(findings.get(k, []))} {k}" for k in KINDS)
    print(f"docs-check: {'ok' if total == 0 else 'FAILED'}: {summary} problems")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
