"""Reading a ``.deb`` and turning its documentation files (HTML or Mallard, roff, POD,
info) into prose paragraphs; each paragraph is kept or dropped by the rules of
:mod:`.clean`."""
from __future__ import annotations

import fnmatch
import gzip
import html.parser
import io
import re
import tarfile
from collections import Counter
from typing import Iterator

from .clean import normalise, paragraph_verdict
from .sources import Source


class BuildError(Exception):
    """A bad input or a failed download: reported as one line by the CLI."""


def deb_members(deb: bytes, want=lambda path: True) -> Iterator[tuple[str, bytes]]:
    """Yield ``(path, bytes)`` of the regular files of a ``.deb``'s data archive for which
    ``want(path)`` is true.

    A ``.deb`` is an ``ar`` archive holding ``data.tar.{xz,gz,}``; read with the standard
    library only (no ``dpkg``). Paths have no leading ``./``.
    """
    if not deb.startswith(b"!<arch>\n"):
        raise BuildError("not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(deb):
        name = deb[pos:pos + 16].decode().strip().rstrip("/")
        size = int(deb[pos + 48:pos + 58].decode().strip())
        body = deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
        if not name.startswith("data.tar"):
            continue
        if name.endswith(".zst"):
            raise BuildError("zstd-compressed .deb: unsupported, use a Debian (xz) package")
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
            for m in tar:
                path = m.name.lstrip("./")
                if m.isfile() and want(path):
                    yield path, tar.extractfile(m).read()
        return
    raise BuildError("no data.tar member in the package")


def select(source: Source, path: str) -> str | None:
    """The format of ``path`` if ``source`` includes it, else None."""
    if any(fnmatch.fnmatchcase(path, g) for g in source.exclude):
        return None
    return next((fmt for g, fmt in source.include if fnmatch.fnmatchcase(path, g)), None)


def decode(raw: bytes) -> str | None:
    """UTF-8 text of a (possibly gzipped) file; None if more than 0.1 % is not UTF-8."""
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8", errors="replace")
    return None if text.count("\ufffd") > len(text) / 1000 else text


_SKIP_TAGS = {"script", "style", "pre", "head", "nav", "header", "footer", "table", "svg",
              "math", "form", "button", "select", "noscript", "screen", "media", "info",
              "links", "synopsis", "comment", "textarea", "iframe", "object"}
_SKIP_CLASS = re.compile(r"sphinxsidebar\w*|related|footer|navheader|navfooter|navigation|"
                         r"nav-\S+|breadcrumbs?|headerlink|highlight(-\S+)?|programlisting|"
                         r"literallayout|screen|\w*synopsis|sourcecode|toctree-wrapper|toc|"
                         r"menu-bar|copyright|example-wrap|linenodiv")
"""Class, id or role tokens whose element is skipped (never on ``html``, ``body``, ``main``)."""
_VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source",
         "track", "embed", "param"}
_BLOCK = {"p", "div", "li", "dd", "dt", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote",
          "section", "article", "ul", "ol", "dl", "figcaption", "caption", "br", "title",
          "item", "note", "list", "terms", "desc", "page", "tr", "td", "th", "hr"}


class _HTMLText(html.parser.HTMLParser):
    """Paragraphs of an HTML (or Mallard XML) page; code, tables and navigation skipped."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._buf: list[str] = []
        self._skip_tag: str | None = None
        self._skip_depth = 0

    def _flush(self) -> None:
        if self._buf:
            self.paragraphs.append("".join(self._buf))
            self._buf = []

    def handle_starttag(self, tag, attrs):
        if self._skip_tag is not None:
            self._skip_depth += tag == self._skip_tag and tag not in _VOID
            return
        marks = " ".join(v or "" for k, v in attrs if k in ("class", "id", "role")).lower()
        skip = tag in _SKIP_TAGS or (tag not in ("html", "body", "main") and any(
            _SKIP_CLASS.fullmatch(m) for m in marks.split()))
        if tag not in _VOID and skip:
            self._flush()
            self._skip_tag, self._skip_depth = tag, 1
        elif tag in _BLOCK:
            self._flush()

    def handle_endtag(self, tag):
        if self._skip_tag is not None:
            if tag == self._skip_tag:
                self._skip_depth -= 1
                if self._skip_depth == 0:
                    self._skip_tag = None
            return
        if tag in _BLOCK:
            self._flush()

    def handle_data(self, data):
        if self._skip_tag is None:
            self._buf.append(data)

    def close(self):
        super().close()
        self._flush()


def html_paragraphs(text: str) -> list[str]:
    """Paragraphs of an HTML or Mallard page (``<pre>``, tables, navigation dropped)."""
    parser = _HTMLText()
    parser.feed(text)
    parser.close()
    return parser.paragraphs


_ROFF_CHARS = {"em": "\u2014", "en": "\u2013", "lq": "\u201c", "rq": "\u201d", "aq": "'",
               "dq": '"', "oq": "\u2018", "cq": "\u2019", "bu": "\u2022", "co": "\u00a9",
               "hy": "-", "mi": "-", "ti": "~", "rs": "\\", "at": "@", "sh": "#", "tm": "(TM)",
               "rg": "(R)", "de": "\u00b0", "mu": "\u00d7", "pl": "+", "eq": "="}
_ROFF_ESCAPE = re.compile(r"\\(?:\((..)|\[([^\]]*)\]|\*(?:\((..)|\[([^\]]*)\]|(.))|"
                          r"f(?:\(..|\[[^\]]*\]|.)|s[+-]?\d+|[&|^%c:!]|(-|e|~| |0|'|`|\.)"
                          r"|[nkgwz]\S?)")
_ROFF_TEXT_MACROS = {"B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "SM", "SB", "SH", "SS",
                     "IP", "TP", "UR", "MT"}
_ROFF_BREAK = {"PP", "LP", "P", "sp", "br", "SH", "SS", "TP", "IP", "HP", "RS", "RE", "TH"}
_ROFF_SKIP = {"nf": "fi", "EX": "EE", "TS": "TE", "EQ": "EN", "de": "..", "ig": ".."}


def _roff_inline(text: str) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3) or m.group(4) or m.group(5)
        if name is not None:
            return _ROFF_CHARS.get(name, "")
        lit = m.group(6)
        if lit is None:
            return ""
        return {"-": "-", "e": "\\", "~": " ", " ": " ", "0": " ", "'": "'", "`": "`",
                ".": "."}[lit]
    return _ROFF_ESCAPE.sub(sub, text)


def roff_paragraphs(text: str) -> list[str]:
    """Paragraphs of a man page: requests dropped, no-fill and table blocks skipped,
    font and character escapes replaced. A ``.so`` alias page gives nothing."""
    paragraphs, buf, end = [], [], None
    for line in text.splitlines():
        if end is not None:
            if line.startswith(("." + end, "'" + end)) or (end == ".." and line == ".."):
                end = None
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            name = parts[0] if parts else ""
            if name == "so":
                return []
            if name in _ROFF_SKIP:
                end = _ROFF_SKIP[name]
            if name in _ROFF_BREAK or name in _ROFF_SKIP:
                if buf:
                    paragraphs.append(" ".join(buf))
                    buf = []
            if name in _ROFF_TEXT_MACROS and len(parts) > 1:
                words = re.findall(r'"[^"]*"|\S+', parts[1])
                buf.append(_roff_inline(("" if name in ("BR", "RB", "IR", "RI", "BI", "IB")
                                         else " ").join(w.strip('"') for w in words)))
                if name in ("SH", "SS"):
                    paragraphs.append(buf.pop())
            continue
        if not line.strip():
            if buf:
                paragraphs.append(" ".join(buf))
                buf = []
            continue
        buf.append(_roff_inline(line))
    if buf:
        paragraphs.append(" ".join(buf))
    return paragraphs


_POD_CODE = re.compile(r"[A-Z]<<+\s+(.*?)\s+>>+|[A-Z]<([^<>]*)>", re.S)
_POD_ENTITY = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}


def _pod_inline(text: str) -> str:
    def sub(m: re.Match) -> str:
        kind = m.group(0)[0]
        inner = m.group(1) if m.group(1) is not None else m.group(2)
        if kind in "XZ":
            return ""
        if kind == "E":
            return _POD_ENTITY.get(inner, "")
        if kind == "L":
            return inner.split("|", 1)[0] if "|" in inner else inner.split("/")[-1].strip('"')
        return inner
    for _ in range(4):
        text, n = _POD_CODE.subn(sub, text)
        if not n:
            break
    return text


def pod_paragraphs(text: str) -> list[str]:
    """Paragraphs of a POD file: headings and items as text, verbatim blocks and
    ``=begin``/``=end`` regions dropped, formatting codes resolved."""
    out, in_pod, region = [], False, None
    for para in re.split(r"\n\s*\n", text):
        if para.startswith("="):
            cmd, _, rest = para[1:].partition(" ")
            cmd = cmd.strip()
            in_pod = cmd != "cut"
            if region is not None:
                region = None if cmd == "end" else region
                continue
            if cmd == "begin":
                region = rest
            elif cmd.startswith("head") or cmd == "item":
                out.append(_pod_inline(rest))
            continue
        if in_pod and region is None and para and not para[0].isspace():
            out.append(_pod_inline(para))
    return out


def info_paragraphs(text: str) -> list[str]:
    """Paragraphs of an info file: node headers, menus, underlines, the tag table and
    indented example blocks dropped."""
    out = []
    for node in text.split("\x1f"):
        lines = node.lstrip("\n").splitlines()
        if not lines or lines[0].startswith(("Tag Table:", "Indirect:", "End Tag Table")):
            continue
        body = "\n".join(lines[1:] if lines[0].startswith("File:") else lines)
        body = body.split("* Menu:", 1)[0]
        for para in re.split(r"\n\s*\n", body):
            kept = [ln for ln in para.splitlines()
                    if ln.strip() and not re.fullmatch(r"\s*[*=\-.]{3,}\s*", ln)]
            if kept and not all(ln.startswith("     ") for ln in kept):
                out.append(" ".join(ln.strip() for ln in kept))
    return out


CONVERTERS = {"html": html_paragraphs, "roff": roff_paragraphs, "pod": pod_paragraphs,
              "info": info_paragraphs}


def convert(fmt: str, raw: bytes, counts: Counter) -> list[str] | None:
    """Prose paragraphs of one file, counting every dropped paragraph by rule; None when
    the file is not UTF-8."""
    text = decode(raw)
    if text is None:
        return None
    kept = []
    for para in CONVERTERS[fmt](text):
        para = normalise(para)
        if not para:
            continue
        counts["read"] += 1
        verdict = paragraph_verdict(para)
        counts[verdict or "kept"] += 1
        if verdict is None:
            kept.append(para)
    return kept
