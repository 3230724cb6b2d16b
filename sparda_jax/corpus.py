"""A token corpus built from Debian packages: prose for training, other domains for evaluation.

`build_corpus` fetches Debian packages (`apt-get download`), unpacks them (`dpkg-deb -x`),
turns their documentation into plain-text documents, drops short and duplicate documents,
tokenizes them and writes token shards plus a manifest:

- split `train`: English documentation prose (the kernel's Documentation, perl pods, the
  PostgreSQL/Python/Rust/Django/... manuals, Debian's reference books);
- split `heldout`: the 1% of the train domains' documents whose (package, path) hash is 0 mod 100;
- splits `eval-info`, `eval-man`, `eval-licenses`: GNU info manuals, Linux man pages and licence
  texts, domains the train split holds none of.

Layout of a corpus directory (format "sparda-tokens/1"):
- `manifest.json`: {"format", "dtype", "tokenizer": {"model", "vocab_size", "eos_id"},
  "splits": {split: {"shards": [{"file", "tokens", "sha256"}], "documents", "tokens",
  "characters", "sources": {package: {"version", "files", "documents", "characters", "tokens"}}}}};
- `<split>-NNNNN.npy`: 1-D numpy arrays (uint16, or uint32 when the vocabulary exceeds 65536 ids,
  as "dtype" says) holding whole documents, each followed by the EOS id; a shard exceeds the
  shard size only when one document alone does;
- `documents.tsv`: one line per document: split, package, path inside the package, characters,
  tokens (in stream order).
"""

from __future__ import annotations

import gzip
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

__all__ = ["FORMAT", "SPLITS", "EVAL_SPLITS", "SourceSpec", "DEFAULT_SOURCES", "default_corpus_dir",
           "build_corpus", "load_split", "load_manifest", "split_documents", "corpus_info",
           "html_to_text", "pod_to_text", "man_to_text", "info_to_text", "prose_share",
           "collect_documents", "fetch_package", "Document"]

FORMAT = "sparda-tokens/1"
EVAL_SPLITS = ("eval-info", "eval-man", "eval-licenses")
SPLITS = ("train", "heldout") + EVAL_SPLITS
KINDS = ("train", "eval", "all")
MIN_CHARS = 500  # shorter documents are dropped (stubs, redirects, index pages)
MIN_PROSE_SHARE = 0.55  # train documents below this share of plain words are dropped (API listings, code)
MAX_NON_ASCII = 0.05  # train documents above this share of non-ASCII characters are dropped (translations)
HELDOUT_MODULUS = 100  # documents whose (package, path) hash is 0 mod this go to `heldout`
DEFAULT_SHARD_TOKENS = 4 * 1024 * 1024


@dataclass(frozen=True)
class SourceSpec:
    """Which files of one Debian package feed which split, and how they are read.

    `include`/`exclude`: globs on the path inside the package (no leading '/'); `*` stays within a
    path component, `**` spans components. `reader`: "auto" (by file suffix: .html/.htm, .pod,
    anything else as text; a trailing .gz is uncompressed first), "info", "man" or "text"."""

    package: str
    split: str
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    reader: str = "auto"

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", self.package):
            raise ValueError(f"not a Debian package name: {self.package!r}")
        if self.split not in ("train",) + EVAL_SPLITS:
            raise ValueError(f"split must be one of {('train',) + EVAL_SPLITS}, got {self.split!r}")
        if not self.include:
            raise ValueError(f"{self.package}: include names no files")
        if self.reader not in ("auto", "info", "man", "text"):
            raise ValueError(f"reader must be auto, info, man or text, got {self.reader!r}")


# every train source also drops these: other domains (man, info, licences), build debris, duplicates
# of the rendered pages (Sphinx's _sources), and index/search pages
_TRAIN_EXCLUDE = ("usr/share/man/**", "usr/share/info/**", "**/copyright", "**/*LICENSE*", "**/*COPYING*",
                  "**/changelog*", "**/_sources/**", "**/_static/**", "**/_modules/**", "**/genindex*.html",
                  "**/search.html", "**/py-modindex.html", "**/translations/**")


def _train(package: str, *include: str, exclude: tuple[str, ...] = ()) -> SourceSpec:
    return SourceSpec(package, "train", include, _TRAIN_EXCLUDE + exclude)


DEFAULT_SOURCES: tuple[SourceSpec, ...] = (
    _train("linux-doc-6.1", "usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz",
           "usr/share/doc/linux-doc-6.1/Documentation/**/*.txt.gz"),
    _train("perl-doc", "usr/share/perl/*/pod/*.pod"),
    _train("postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html/*.html"),
    _train("python3.11-doc", "usr/share/doc/python3.11/html/**/*.html"),
    _train("rust-doc", "usr/share/doc/rust-doc/html/**/*.html",
           # std re-exports core and alloc: their pages would be near-copies of std's
           exclude=("usr/share/doc/rust-doc/html/src/**", "usr/share/doc/rust-doc/html/core/**",
                    "usr/share/doc/rust-doc/html/alloc/**", "**/arch/**", "**/implementors/**")),
    _train("debian-reference-en", "usr/share/debian-reference/*.en.html"),
    _train("developers-reference", "usr/share/developers-reference/*.html",
           exclude=("**/developers-reference.html",)),  # the single-page copy of the other pages
    _train("maint-guide", "usr/share/doc/maint-guide/html/*.en.html"),
    _train("git-doc", "usr/share/doc/git-doc/**/*.html",
           exclude=("usr/share/doc/git-doc/git-*.html",)),  # the command pages are manual pages
    _train("debian-handbook", "usr/share/doc/debian-handbook/html/en-US/*.html"),
    _train("debian-policy", "usr/share/doc/debian-policy/*.html", "usr/share/doc/debian-policy/fhs/*.html"),
    _train("python-django-doc", "usr/share/doc/python-django-doc/html/**/*.html"),
    _train("exim4-doc-html", "usr/share/doc/exim4-doc-html/spec_html/*.html"),
    _train("apache2-doc", "usr/share/doc/apache2-doc/manual/en/**/*.html",
           exclude=("usr/share/doc/apache2-doc/manual/en/programs/**",)),  # manual pages
    _train("gimp-help-en", "usr/share/gimp/2.0/help/en/**/*.html"),
    _train("sqlite3-doc", "usr/share/doc/sqlite3/**/*.html"),
    _train("cmake-doc", "usr/share/doc/cmake-data/html/**/*.html",
           exclude=("usr/share/doc/cmake-data/html/manual/*.1.html",)),  # manual pages
    _train("sphinx-doc", "usr/share/doc/sphinx-doc/html/**/*.html"),
    _train("bind9-doc", "usr/share/doc/bind9-doc/arm/*.html"),
    _train("postfix-doc", "usr/share/doc/postfix/html/*.html",
           exclude=("usr/share/doc/postfix/html/*.[0-9].html",)),  # manual pages
    _train("libvirt-doc", "usr/share/doc/libvirt-doc/html/**/*.html",
           exclude=("usr/share/doc/libvirt-doc/html/manpages/**",)),
    _train("python-pandas-doc", "usr/share/doc/python-pandas-doc/html/**/*.html",
           exclude=("**/reference/api/**", "**/generated/**")),
    _train("installation-guide-amd64", "usr/share/doc/installation-guide-amd64/en/*.html"),
    _train("vim-doc", "usr/share/doc/vim/html/*.html"),
    _train("nodejs-doc", "usr/share/doc/nodejs/api/*.html"),
    _train("kicad-doc-en", "usr/share/doc/kicad/help/en/*.html"),
    _train("python-sqlalchemy-doc", "usr/share/doc/python-sqlalchemy-doc/html/**/*.html"),
    _train("python-celery-doc", "usr/share/doc/python-celery-doc/html/**/*.html", exclude=("**/reference/**",)),
    _train("python-flask-doc", "usr/share/doc/python-flask-doc/html/**/*.html"),
    _train("python-werkzeug-doc", "usr/share/doc/python-werkzeug-doc/html/**/*.html"),
    _train("python-pytest-doc", "usr/share/doc/python-pytest-doc/html/**/*.html"),
    _train("python-sklearn-doc", "usr/share/doc/python-sklearn-doc/html/**/*.html",
           exclude=("**/generated/**", "**/auto_examples/**", "**/_downloads/**")),
    _train("python-sympy-doc", "usr/share/doc/python-sympy-doc/html/**/*.html"),
    _train("python-astropy-doc", "usr/share/doc/python-astropy-doc/html/**/*.html", exclude=("**/api/**",)),
    _train("python-statsmodels-doc", "usr/share/doc/python-statsmodels-doc/html/**/*.html",
           exclude=("**/generated/**",)),
    *(SourceSpec(p, "eval-info", ("usr/share/info/*.info*.gz",), reader="info")
      for p in ("automake", "bc", "coreutils", "diffutils", "findutils", "grep", "gzip", "m4", "sed", "wget")),
    *(SourceSpec(p, "eval-man", ("usr/share/man/man*/*.gz",), reader="man") for p in ("manpages", "manpages-dev")),
    SourceSpec("base-files", "eval-licenses", ("usr/share/common-licenses/*",), reader="text"),
    *(SourceSpec(p, "eval-licenses", (f"usr/share/doc/{p}/copyright",), reader="text")
      for p in ("git-doc", "linux-doc-6.1", "perl-doc", "postgresql-doc-15", "rust-doc")),
)


def default_corpus_dir() -> Path:
    """`default_cache_dir()`/corpus: $SPARDA_JAX_CACHE_DIR/corpus, else ~/.cache/sparda-jax/corpus."""
    from .runtime import default_cache_dir

    return default_cache_dir() / "corpus"


# ----------------------------------------------------------------------------------------------
# text extraction


_BLOCK = {"p", "div", "section", "article", "main", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd",
          "pre", "br", "tr", "table", "blockquote", "ul", "ol", "dl", "hr", "figure", "figcaption",
          "caption", "td", "th", "body", "center"}
_SKIP_TAGS = {"script", "style", "nav", "footer", "header", "head", "noscript", "form", "button", "svg",
              "aside", "iframe", "select", "textarea", "template", "map"}
_NEVER_SKIP = {"html", "body", "main", "article"}  # their classes describe the page, not furniture
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
         "track", "wbr"}
# class/id/role words of navigation and page furniture in the generators Debian's docs use
# (Sphinx, DocBook, mdBook, rustdoc, asciidoc, Apache's and PostgreSQL's own)
_BOILERPLATE = re.compile(r"(?:^|[\s_-])(?:sidebar|sphinxsidebar\w*|related|footer|header|navheader|navfooter|"
                          r"navigation|nav|navbar|breadcrumbs?|menu|menu-bar|search\w*|headerlink|toc|"
                          r"toctree-wrapper|nav-chapters|nav-wrapper|mobile-nav-chapters|skip-link|"
                          r"copyright|langs?|top|up|bottomlang|page-header|page-footer|version-switch|"
                          r"settings-menu|out-of-band|src-link|anchor|theme-popup)(?:$|[\s_-])", re.I)


class _HtmlText(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # (tag, inside skipped content)
        self.lines: list[str] = []
        self.line: list[str] = []
        self.pre = 0

    @property
    def skipping(self) -> bool:
        return bool(self.stack) and self.stack[-1][1]

    def flush(self):
        text = "".join(self.line)
        self.line = []
        if self.pre:
            self.lines.extend(text.split("\n"))
        else:
            text = " ".join(text.split())
            if text == "-":  # a list item whose content was all furniture
                text = ""
            if text:
                self.lines.append(text)
            elif self.lines and self.lines[-1]:
                self.lines.append("")

    def handle_starttag(self, tag, attrs):
        if tag in _BLOCK and not self.skipping:
            self.flush()
        if tag in _VOID:
            return
        a = dict(attrs)
        marks = " ".join(a.get(k) or "" for k in ("class", "id", "role"))
        skip = self.skipping or tag in _SKIP_TAGS or (
            tag not in _NEVER_SKIP and bool(marks and _BOILERPLATE.search(marks)))
        self.stack.append((tag, skip))
        if tag == "pre" and not skip:
            self.pre += 1
        if tag == "li" and not skip:
            self.line.append("- ")

    def handle_startendtag(self, tag, attrs):
        if tag in _BLOCK and not self.skipping:
            self.flush()

    def handle_endtag(self, tag):
        if not any(t == tag for t, _ in self.stack):
            return  # a stray end tag
        while self.stack:
            t, skip = self.stack.pop()
            if t == "pre" and not skip:
                self.flush()
                self.pre -= 1
            if t == tag:
                break
        if tag in _BLOCK and not self.skipping:
            self.flush()

    def handle_data(self, data):
        if not self.skipping:
            self.line.append(data)

    def text(self) -> str:
        self.flush()
        return _tidy("\n".join(self.lines))


def _tidy(text: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines to one, strip the ends."""
    text = re.sub(r"[ \t]+\n", "\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def html_to_text(source: str) -> str:
    """The readable text of an HTML page: paragraphs, headings, list items (as "- item") and table
    cells one per line, <pre> blocks verbatim; scripts, styles, <head>, and navigation, sidebars,
    headers and footers (by tag, or by class/id/role) dropped."""
    p = _HtmlText()
    p.feed(source)
    p.close()
    return p.text()


_POD_CODE = re.compile(r"([A-Z])<(?!<)([^<>]*)>")
_POD_CODE_LONG = re.compile(r"([A-Z])<{2,}\s+(.*?)\s+>{2,}", re.S)
_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_code(m: re.Match) -> str:
    code, inner = m.group(1), m.group(2)
    if code == "E":
        try:  # E<0x3E> hex, E<076> octal, E<62> decimal
            if inner.lower().startswith("0x"):
                return chr(int(inner[2:], 16))
            if inner.isdigit():
                return chr(int(inner, 8) if inner.startswith("0") else int(inner))
        except ValueError:
            return inner
        return _POD_ESCAPES.get(inner, html.unescape(f"&{inner};"))
    if code in ("X", "Z"):
        return ""
    if code == "L":
        text = inner.split("|", 1)[0] if "|" in inner else inner
        return text.replace('"', "")
    return inner


def pod_to_text(source: str) -> str:
    """Perl POD as plain text: =head/=item lines become their text, =begin..=end and other
    commands are dropped, formatting codes (B<>, C<<>>, L<text|target>, E<gt>, ...) unwrapped."""
    out, skip = [], False
    for line in source.splitlines():
        if line.startswith("="):
            cmd, _, rest = line.partition(" ")
            if cmd == "=begin":
                skip = True
            elif cmd == "=end":
                skip = False
            elif cmd.startswith("=head"):
                out.extend(["", rest.strip(), ""])
            elif cmd == "=item":
                out.append("- " + rest.strip() if rest.strip() not in ("*", "") else "-")
            continue
        if not skip:
            out.append(line)
    text = "\n".join(out)
    for _ in range(4):  # nested codes: unwrap from the inside out
        text = _POD_CODE_LONG.sub(_pod_code, text)
        new = _POD_CODE.sub(_pod_code, text)
        if new == text:
            break
        text = new
    return _tidy(text)


_MAN_CHARS = {"em": "\u2014", "en": "\u2013", "aq": "'", "dq": '"', "lq": '"', "rq": '"', "oq": "'", "cq": "'",
              "bu": "\u2022", "co": "\u00a9", "rg": "\u00ae", "mu": "\u00d7", "ti": "~", "ha": "^", "rs": "\\",
              "hy": "-", "mi": "-", "pl": "+", "eq": "=", "ga": "`", "ac": "'", "lh": "<=", "rh": "=>",
              "<=": "<=", ">=": ">=", "->": "->", "<-": "<-", "de": "\u00b0", "+-": "\u00b1", "sc": "\u00a7",
              "Fo": "\u00ab", "Fc": "\u00bb", "ul": "_", "ba": "|", "br": "|", "sq": "\u25a1", "tm": "(TM)"}
_MAN_FONT_MACROS = {"B", "I", "SM", "SB"}
_MAN_ALT_MACROS = {"BR", "RB", "IR", "RI", "BI", "IB"}
_MAN_HEADINGS = {"SH", "SS"}


def _man_escapes(s: str) -> str:
    s = re.sub(r"\\f(?:\(..|\[[^\]]*\]|.)", "", s)  # font changes
    s = re.sub(r"\\s[+-]?\d", "", s)  # size changes
    s = re.sub(r"\\\*(?:\(..|\[[^\]]*\]|.)", '"', s)  # predefined strings (lq/rq/R/Tm in man pages)
    s = re.sub(r"\\\((..)", lambda m: _MAN_CHARS.get(m.group(1), ""), s)
    s = re.sub(r"\\\[([^\]]*)\]", lambda m: _MAN_CHARS.get(m.group(1), ""), s)
    s = re.sub(r"\\[nk](?:\(..|\[[^\]]*\]|.)", "", s)  # registers
    s = re.sub(r"\\[hvwoxXlLDbZR]'[^']*'", "", s)  # motions and drawing
    s = s.replace("\\-", "-").replace("\\e", "\\\\").replace("\\ ", " ").replace("\\~", " ")
    s = re.sub(r"\\[&|^%:c0dut!{}]", "", s)
    s = s.replace("\\\\", "\\")
    return s


def _man_args(rest: str) -> list[str]:
    args, cur, quoted, i = [], "", False, 0
    while i < len(rest):
        ch = rest[i]
        if ch == '"':
            if quoted and i + 1 < len(rest) and rest[i + 1] == '"':
                cur += '"'
                i += 1
            else:
                quoted = not quoted
        elif ch in " \t" and not quoted:
            if cur:
                args.append(cur)
            cur = ""
        else:
            cur += ch
        i += 1
    if cur:
        args.append(cur)
    return args


def man_to_text(source: str) -> str:
    """A troff man page (man(7) macros) as plain text, in pure Python: comments and layout
    requests dropped, .TH as "NAME(SECTION)", section headings and .TP/.IP tags on their own
    lines, font macros (.B, .BR, ...) and escapes (\\fB, \\(em, \\-, ...) reduced to their text,
    filled text joined into one line per paragraph (.nf/.EX blocks kept line by line), tbl
    format lines dropped."""
    source = re.sub(r"(?<!\\)\\\n", "", source)  # an escaped newline continues the line
    out: list[str] = []
    para: list[str] = []
    fill, tag_next = True, False
    in_table = table_format = False

    def brk(blank: bool = False):
        if para:
            out.append(" ".join(para))
            para.clear()
        if blank and out and out[-1]:
            out.append("")

    def text(t: str):
        nonlocal tag_next
        if tag_next:  # the tag line of a .TP paragraph
            brk()
            out.append(t)
            tag_next = False
        elif not fill:
            out.append(t)
        elif t.strip():
            para.append(t.strip())
        else:
            brk(blank=True)

    for line in source.splitlines():
        line = line.rstrip()
        if line.startswith(('.\\"', "'\\\"", '\\"')) or line in (".", "'"):
            continue
        if in_table:
            if line.startswith(".TE"):
                in_table = False
                out.append("")
            elif table_format:
                table_format = not line.endswith(".")
            elif line.startswith(".T&"):
                table_format = True
            elif not line.startswith((".", "'")):
                out.append(_man_escapes(line.replace("\t", "  ").replace("T{", "").replace("T}", "")))
            continue
        if not line.startswith((".", "'")):
            text(_man_escapes(line))
            continue
        m = re.match(r"[.']\s*(\S+)\s*(.*)", line)
        if not m:
            continue
        macro, rest = m.group(1), m.group(2)
        if macro == "TS":
            brk(blank=True)
            in_table = table_format = True
        elif macro == "TH":
            brk()
            a = _man_args(rest)
            out.extend([f"{a[0]}({a[1]})" if len(a) > 1 else " ".join(a), ""])
        elif macro in _MAN_HEADINGS:
            brk(blank=True)
            out.extend([_man_escapes(" ".join(_man_args(rest))), ""])
        elif macro in _MAN_FONT_MACROS:
            if rest:
                text(_man_escapes(" ".join(_man_args(rest))))
        elif macro in _MAN_ALT_MACROS:
            text(_man_escapes("".join(_man_args(rest))))
        elif macro in ("TP", "TQ"):
            brk(blank=macro == "TP")
            tag_next = True
        elif macro == "IP":
            brk(blank=True)
            a = _man_args(rest)
            if a and a[0] not in ("\\(bu", "\\[bu]", "*", "-"):
                out.append(_man_escapes(a[0]))
        elif macro in ("nf", "EX"):
            brk()
            fill = False
        elif macro in ("fi", "EE"):
            fill = True
        elif macro in ("PP", "LP", "P", "sp", "HP"):
            brk(blank=True)
        elif macro in ("br", "RS", "RE", "in", "ti", "SY", "YS"):
            brk()
        elif macro in ("UE", "ME", "OP") and rest:
            text(_man_escapes(" ".join(_man_args(rest))))
        # every other request (.UR, .ft, .ad, .so, ...): layout only
    brk()
    return _tidy("\n".join(out))


def info_to_text(source: str) -> str:
    """A GNU info file as plain text: node header lines, menus ("* Menu:" blocks), the dir entry,
    the indirect table and the tag table dropped; node text kept."""
    text = source.split("\x1fTag Table:")[0].split("\x1f\nTag Table:")[0]
    out, in_menu, in_dir = [], False, False
    for chunk in text.split("\x1f"):
        lines = chunk.lstrip("\n").splitlines()
        if not lines:
            continue
        if lines[0].startswith("Indirect:") or lines[0].startswith("Tag Table:"):
            continue
        if lines[0].startswith("File:") and "Node:" in lines[0]:
            lines = lines[1:]
        for line in lines:
            if line.startswith("START-INFO-DIR-ENTRY"):
                in_dir = True
            if in_dir:
                in_dir = not line.startswith("END-INFO-DIR-ENTRY")
                continue
            if line.startswith("INFO-DIR-SECTION"):
                continue
            if line.startswith("* Menu:"):
                in_menu = True
                continue
            if in_menu:
                if line.startswith("* ") or line.startswith(" ") or not line.strip():
                    continue
                in_menu = False
            out.append(line)
        out.append("")
    return _tidy("\n".join(out))


_WORD = re.compile(r"[(\"'\u2018\u201c]?[A-Za-z][a-z]*(?:['\u2019-][a-z]+)*[.,;:!?)\"'\u2019\u201d]*")


def prose_share(text: str) -> float:
    """The share of whitespace-separated tokens that are plain words (letters, optionally wrapped in
    quotes/brackets or followed by punctuation): about 0.7-0.9 for prose, lower for code and API
    listings. 0.0 for empty text."""
    toks = text.split()
    if not toks:
        return 0.0
    return sum(1 for t in toks if len(t) <= 24 and _WORD.fullmatch(t)) / len(toks)


def _read_file(path: Path, reader: str, rel: str) -> str:
    data = path.read_bytes()
    name = rel
    if name.endswith(".gz"):
        data = gzip.decompress(data)
        name = name[:-3]
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError:
        source = data.decode("latin-1")
    if reader == "info":
        return info_to_text(source)
    if reader == "man":
        return man_to_text(source)
    if reader == "auto":
        if name.endswith((".html", ".htm", ".xhtml")):
            return html_to_text(source)
        if name.endswith(".pod"):
            return pod_to_text(source)
    return _tidy(source)


# ----------------------------------------------------------------------------------------------
# packages


def _glob_re(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out += pattern[i:j + 1]
            i = j + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def _deb_field(deb: Path, field: str) -> str:
    r = subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True)
    if r.returncode != 0:
        raise ValueError(f"{deb}: not a readable .deb ({r.stderr.strip()})")
    return r.stdout.strip()


def _version_key(version: str):
    import functools

    def cmp(a, b):
        if a == b:
            return 0
        lt = subprocess.run(["dpkg", "--compare-versions", a, "lt", b]).returncode == 0
        return -1 if lt else 1

    return functools.cmp_to_key(cmp)(version)


def fetch_package(package: str, cache_dir: Path, *, log=None) -> tuple[Path, str]:
    """The unpacked tree of `package` under cache_dir/unpacked and its version: a .deb already in
    cache_dir/debs is used, else one is fetched with `apt-get download` (the newest of several).
    Raises FileNotFoundError when dpkg-deb (or apt-get, for a missing .deb) is not installed,
    ValueError when apt-get cannot fetch the package."""
    if shutil.which("dpkg-deb") is None:
        raise FileNotFoundError("dpkg-deb is not installed (the corpus is built from Debian packages)")
    debs_dir = cache_dir / "debs"
    debs_dir.mkdir(parents=True, exist_ok=True)
    found = [d for d in debs_dir.glob(f"{package}_*.deb") if _deb_field(d, "Package") == package]
    if not found:
        if shutil.which("apt-get") is None:
            raise FileNotFoundError(f"{package}: no .deb in {debs_dir} and apt-get is not installed")
        if log:
            log(f"apt-get download {package}")
        r = subprocess.run(["apt-get", "download", package], cwd=debs_dir, capture_output=True, text=True)
        if r.returncode != 0:
            raise ValueError(f"apt-get download {package} failed: {r.stderr.strip()[-500:]}")
        found = [d for d in debs_dir.glob(f"{package}_*.deb") if _deb_field(d, "Package") == package]
        if not found:
            raise ValueError(f"apt-get download {package} left no {package}_*.deb in {debs_dir}")
    versions = {d: _deb_field(d, "Version") for d in found}
    deb = max(found, key=lambda d: _version_key(versions[d])) if len(found) > 1 else found[0]
    version = versions[deb]
    root = cache_dir / "unpacked" / f"{package}_{version.replace(':', '%3a')}"
    done = root / ".unpacked"
    if not done.exists():
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        r = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
        if r.returncode != 0:
            raise ValueError(f"dpkg-deb -x {deb} failed: {r.stderr.strip()}")
        done.write_text(version)
    return root, version


@dataclass(frozen=True)
class Document:
    split: str  # "train", "heldout" or an eval split
    package: str
    path: str  # inside the package
    text: str


def _heldout(package: str, path: str) -> bool:
    h = int.from_bytes(hashlib.sha256(f"{package}/{path}".encode()).digest()[:8], "big")
    return h % HELDOUT_MODULUS == 0


def collect_documents(specs, cache_dir: Path, *, progress: bool = True, log=None) -> tuple[list[Document], dict]:
    """The documents of `specs` in a fixed order (specs by split, then package, then path, sorted),
    with short (< MIN_CHARS), non-prose and non-English train documents and exact duplicates (the
    first occurrence wins) dropped; train documents whose (package, path) hash is 0 mod 100 become
    `heldout`. Also returns {package: version}."""
    from tqdm import tqdm

    order = {s: i for i, s in enumerate(("train",) + EVAL_SPLITS)}
    specs = sorted(specs, key=lambda s: (order[s.split], s.package))
    seen: set[bytes] = set()
    docs: list[Document] = []
    versions: dict[str, str] = {}
    for spec in specs:
        root, version = fetch_package(spec.package, cache_dir, log=log)
        versions[spec.package] = version
        inc = [_glob_re(p) for p in spec.include]
        exc = [_glob_re(p) for p in spec.exclude]
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for f in filenames:
                full = Path(dirpath) / f
                rel = full.relative_to(root).as_posix()
                if full.is_symlink() or not full.is_file():
                    continue
                if any(r.match(rel) for r in inc) and not any(r.match(rel) for r in exc):
                    files.append(rel)
        files.sort()
        if not files:
            raise ValueError(f"{spec.package} {version}: no files match {list(spec.include)}")
        for rel in tqdm(files, desc=f"{spec.split}: {spec.package}", unit="file", disable=not progress,
                        leave=False):
            try:
                text = _read_file(root / rel, spec.reader, rel)
            except (OSError, EOFError, ValueError) as e:  # gzip.BadGzipFile is an OSError
                raise ValueError(f"{spec.package}: cannot read {rel}: {e}") from e
            if len(text) < MIN_CHARS:
                continue
            if spec.split == "train":
                if sum(ord(ch) > 127 for ch in text) > MAX_NON_ASCII * len(text):
                    continue
                if prose_share(text) < MIN_PROSE_SHARE:
                    continue
            digest = hashlib.sha256(text.encode()).digest()
            if digest in seen:
                continue
            seen.add(digest)
            split = "heldout" if spec.split == "train" and _heldout(spec.package, rel) else spec.split
            docs.append(Document(split, spec.package, rel, text))
    return docs, versions


# ----------------------------------------------------------------------------------------------
# tokens


def _batch_encoder(tokenizer):
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: [tokenizer.encode(t) for t in texts]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_split(out: Path, split: str, docs: list[Document], token_lists: list[np.ndarray], *, eos_id: int,
                 dtype, shard_tokens: int, versions: dict[str, str]) -> dict:
    for old in out.glob(f"{split}-*.npy"):
        old.unlink()
    shards, pending, pending_n = [], [], 0

    def close():
        nonlocal pending, pending_n
        arr = np.concatenate(pending).astype(dtype)
        name = f"{split}-{len(shards):05d}.npy"
        np.save(out / name, arr)
        shards.append({"file": name, "tokens": int(arr.size), "sha256": _sha256(out / name)})
        pending, pending_n = [], 0

    sources: dict[str, dict] = {}
    for d, ids in zip(docs, token_lists):
        n = len(ids) + 1
        if pending and pending_n + n > shard_tokens:
            close()
        pending.append(np.append(np.asarray(ids, np.int64), eos_id))
        pending_n += n
        s = sources.setdefault(d.package, {"version": versions[d.package], "files": 0, "documents": 0,
                                           "characters": 0, "tokens": 0})
        s["files"] += 1
        s["documents"] += 1
        s["characters"] += len(d.text)
        s["tokens"] += n
    if pending:
        close()
    return {"shards": shards, "documents": len(docs), "tokens": sum(s["tokens"] for s in shards),
            "characters": sum(len(d.text) for d in docs), "sources": dict(sorted(sources.items()))}


def build_corpus(out, tokenizer, *, eos_id: int, packages=None, kind: str = "all",
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, cache_dir=None, model_name: str | None = None,
                 vocab_size: int | None = None, sources=DEFAULT_SOURCES, progress: bool = True,
                 log=None) -> dict:
    """Build the token corpus into directory `out`; returns the manifest (also written there).

    tokenizer: `.encode(str) -> list[int]` (its HF `.backend`, when present, encodes in batches).
    eos_id: the id that ends every document. packages: restrict to these package names (None: all
    of `sources`). kind: "train" (train + heldout), "eval" (the eval-* splits) or "all".
    shard_tokens: the most tokens per shard file (a longer document gets a shard of its own).
    cache_dir: where .debs and unpacked trees are kept (default `default_corpus_dir()`).
    model_name / vocab_size: recorded in the manifest (default: the tokenizer's `name` /
    `vocab_size`). A split is rebuilt from the chosen packages alone; the splits of an earlier
    manifest in `out` (same tokenizer) that no chosen package feeds are kept. Raises ValueError on bad arguments, on a package no source names,
    and on ids outside the vocabulary."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ValueError(f"shard_tokens must be an int >= 1, got {shard_tokens!r}")
    if isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer)) or eos_id < 0:
        raise ValueError(f"eos_id must be an int >= 0, got {eos_id!r}")
    vocab_size = vocab_size if vocab_size is not None else getattr(tokenizer, "vocab_size", None)
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError("the tokenizer has no vocab_size: pass vocab_size=")
    if eos_id >= vocab_size:
        raise ValueError(f"eos_id {eos_id} is outside the vocabulary ({vocab_size} ids)")
    model_name = model_name or getattr(tokenizer, "name", None) or type(tokenizer).__name__
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    wanted = {"train": ("train",), "eval": EVAL_SPLITS, "all": ("train",) + EVAL_SPLITS}[kind]
    specs = [s for s in sources if s.split in wanted]
    if packages is not None:
        packages = list(packages)
        known = sorted({s.package for s in specs})
        unknown = [p for p in packages if p not in known]
        if unknown:
            raise ValueError(f"no {kind} source names {unknown}; known: {', '.join(known)}")
        specs = [s for s in specs if s.package in packages]
    if not specs:
        raise ValueError("no sources to build")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_corpus_dir()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    docs, versions = collect_documents(specs, cache_dir, progress=progress, log=log)
    from tqdm import tqdm

    encode = _batch_encoder(tokenizer)
    token_lists: list[np.ndarray] = []
    chunk = 256
    with tqdm(total=sum(len(d.text) for d in docs), desc="tokenize", unit="char", unit_scale=True,
              disable=not progress) as bar:
        for i in range(0, len(docs), chunk):
            part = docs[i:i + chunk]
            token_lists.extend(np.asarray(ids, np.int64) for ids in encode([d.text for d in part]))
            bar.update(sum(len(d.text) for d in part))
    # a document whose text encodes to the EOS id (a special token spelled out) would split in two
    clash = [i for i, t in enumerate(token_lists) if (t == eos_id).any()]
    if clash and log:
        log(f"dropped {len(clash)} documents whose text encodes to the EOS id: "
            + ", ".join(f"{docs[i].package}/{docs[i].path}" for i in clash[:5]))
    keep = sorted(set(range(len(docs))) - set(clash))
    docs, token_lists = [docs[i] for i in keep], [token_lists[i] for i in keep]
    top = max((int(t.max()) for t in token_lists if t.size), default=0)
    if top >= vocab_size:
        raise ValueError(f"the tokenizer produced id {top}, outside its vocabulary of {vocab_size}")

    tokenizer_meta = {"model": model_name, "vocab_size": vocab_size, "eos_id": int(eos_id)}
    splits: dict[str, dict] = {}
    try:
        old = load_manifest(out)
        if old["tokenizer"] == tokenizer_meta and old.get("dtype") == np.dtype(dtype).name:
            splits = dict(old["splits"])
    except (FileNotFoundError, ValueError):
        pass
    fed = {s.split for s in specs} | ({"heldout"} if any(s.split == "train" for s in specs) else set())
    built = [s for s in SPLITS if s in fed]
    for split in built:
        idx = [i for i, d in enumerate(docs) if d.split == split]
        if not idx:
            splits.pop(split, None)
            for old_file in out.glob(f"{split}-*.npy"):
                old_file.unlink()
            continue
        splits[split] = _write_split(out, split, [docs[i] for i in idx], [token_lists[i] for i in idx],
                                     eos_id=int(eos_id), dtype=dtype, shard_tokens=shard_tokens, versions=versions)
    for split in SPLITS:  # shards of splits a fresh manifest no longer lists
        if split not in splits:
            for old_file in out.glob(f"{split}-*.npy"):
                old_file.unlink()
    rows = [f"{d.split}\t{d.package}\t{d.path}\t{len(d.text)}\t{len(t) + 1}" for d, t in zip(docs, token_lists)]
    index = out / "documents.tsv"
    kept = []
    if index.exists():
        kept = [r for r in index.read_text().splitlines()[1:] if r.split("\t", 1)[0] not in built
                and r.split("\t", 1)[0] in splits]
    index.write_text("split\tpackage\tpath\tcharacters\ttokens\n" + "".join(r + "\n" for r in kept + rows))
    manifest = {"format": FORMAT, "dtype": np.dtype(dtype).name, "tokenizer": tokenizer_meta,
                "splits": {s: splits[s] for s in SPLITS if s in splits}}
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(out / "manifest.json")
    return manifest


def load_manifest(directory) -> dict:
    """The manifest of a corpus directory. Raises FileNotFoundError (no directory / manifest),
    ValueError (unreadable JSON, another format)."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"corpus directory not found: {d}")
    path = d / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{d} holds no manifest.json (build one with `sparda corpus build --out {d}`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(f"{path}: format {got!r}, expected {FORMAT!r}")
    for key in ("tokenizer", "splits"):
        if not isinstance(manifest.get(key), dict):
            raise ValueError(f"{path}: no {key!r} object")
    return manifest


def load_split(directory, split: str, *, verify: bool = True) -> np.ndarray:
    """The token stream of one split: 1-D int32, its shards concatenated in order (each document
    followed by the EOS id). verify: check every shard's sha256 against the manifest. Always checks
    each shard's length and that it is 1-D. Raises FileNotFoundError (directory, manifest or shard
    missing), ValueError (another format, unknown split, corrupt shard)."""
    d = Path(directory)
    manifest = load_manifest(d)
    splits = manifest["splits"]
    if split not in splits:
        raise ValueError(f"{d}: no split {split!r}; it holds {', '.join(splits) or 'none'}")
    parts = []
    for shard in splits[split]["shards"]:
        path = d / shard["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{d}: shard {shard['file']} of split {split!r} is missing")
        if verify and _sha256(path) != shard["sha256"]:
            raise ValueError(f"{path}: checksum mismatch (corrupt or replaced shard); rebuild the corpus "
                             f"or copy the shard again")
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a readable .npy shard ({e})") from None
        if arr.ndim != 1 or arr.size != shard["tokens"]:
            raise ValueError(f"{path}: shape {arr.shape}, the manifest says {shard['tokens']} tokens (1-D)")
        parts.append(np.asarray(arr, np.int32))
    if not parts:
        return np.zeros(0, np.int32)
    return np.concatenate(parts)


def split_documents(tokens, eos_id: int) -> list[np.ndarray]:
    """The documents of a token stream: the pieces between EOS ids, without them. A trailing
    piece with no EOS after it (a stream cut mid-document) is returned too."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    ends = np.flatnonzero(tokens == eos_id)
    docs, start = [], 0
    for e in ends:
        docs.append(tokens[start:e])
        start = e + 1
    if start < tokens.size:
        docs.append(tokens[start:])
    return docs


def corpus_info(directory) -> str:
    """A readable summary of a corpus directory: tokenizer, then per split its documents, tokens,
    shards and per-package versions and tokens."""
    d = Path(directory)
    m = load_manifest(d)
    t = m["tokenizer"]
    lines = [f"{d}: {m['format']}, {m.get('dtype', 'uint16')}, tokenizer {t['model']} "
             f"(vocab {t['vocab_size']}, eos {t['eos_id']})"]
    for split, s in m["splits"].items():
        size = sum((d / sh["file"]).stat().st_size for sh in s["shards"] if (d / sh["file"]).is_file())
        lines.append(f"{split}: {s['documents']} documents, {s['tokens']:,} tokens, {len(s['shards'])} shards "
                     f"({size / 1e6:.1f} MB)")
        for pkg, src in s["sources"].items():
            lines.append(f"  {pkg} {src['version']}: {src['files']} files, {src['tokens']:,} tokens")
    return "\n".join(lines)
