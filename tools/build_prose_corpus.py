"""Build the English prose corpus from pinned Debian documentation packages.

The sources are manuals, guides and references shipped as Debian packages (``apt-get
download``, no hub): HTML, man pages (roff), POD and info files. Each file is converted to
paragraphs, paragraphs that are not prose (code, tables, lists of names, headings) are
dropped by measured rules, paragraphs repeated across documents (navigation, licence
blurbs) are removed as boilerplate, then exact and near-duplicate documents. The result is
JSON lines (``{"text", "source", "path"}``, one document per file) that ``lrattn-preprocess``
reads, its gzip copy, and a manifest with per-source counts, licences, filter counts and
digests. The same packages give the same bytes.

    python tools/build_prose_corpus.py --out data/prose --vocab-size 8192
    lrattn-preprocess --input data/prose/prose.jsonl.gz --output-prefix data/prose/prose \\
        --tokenizer data/prose/tokenizer --workers 2
"""
from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import html.parser
import io
import json
import lzma
import re
import subprocess
import sys
import tarfile
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Source:
    """One Debian package and the files of it that hold English prose.

    Attributes:
        package: Debian package name.
        version: pinned version (``apt-get download package=version``).
        sha256: digest of the pinned ``.deb``; None skips the check (test fixtures).
        licence: licence of the included text, from the package's copyright file.
        include: ``(glob, format)`` pairs over member paths (``fnmatch``; ``*`` crosses
            ``/``); format is ``html``, ``roff``, ``pod`` or ``info``.
        exclude: globs of member paths to leave out (indexes, translations, code).
    """

    package: str
    version: str
    sha256: str | None
    licence: str
    include: tuple[tuple[str, str], ...]
    exclude: tuple[str, ...] = ()


SOURCES: tuple[Source, ...] = (
    Source("debian-handbook", "11.20220922",
           "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
           "CC-BY-SA-3.0 or GPL-2+",
           (("usr/share/doc/debian-handbook/html/en-US/*.html", "html"),)),
    Source("debian-reference-en", "2.100",
           "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f",
           "GPL-2+",
           (("usr/share/debian-reference/*.en.html", "html"),), ("*/index.en.html",)),
    Source("developers-reference", "12.18",
           "0dba82f6fa16e373f2a84ad07e7971aa9264ad2e7d2ae46b37edbc9c5fd57e2e",
           "MIT",
           (("usr/share/developers-reference/*.html", "html"),), ("*/_sources/*",)),
    Source("maint-guide", "1.2.53",
           "762c8a400a36668d2eb814a3ba356b06488fd889dfce478eb11d5cfb189a47b5",
           "GPL-2+",
           (("usr/share/doc/maint-guide/html/*.en.html", "html"),)),
    Source("debian-policy", "4.6.2.0",
           "ef9d01b625c3b87c3a845c2cd1b66f1a16e9240b2b9e5bee53472a00e8457a39",
           "GPL-2+",
           (("usr/share/doc/debian-policy/*.html", "html"),), ("*/_sources/*", "*/index.html")),
    Source("debian-faq", "11.1",
           "427426e0cfa6888622fc1d72631071cb4b5a1f86ccde722e7820bcef284de5d0",
           "GPL-2+",
           (("usr/share/doc/debian/FAQ/*.en.html", "html"),)),
    Source("debian-history", "2.28",
           "ae364cdfd075bf6a08ca8f5105b44db7093e3b201c95d3b70a863b8849c6a082",
           "GPL-2+",
           (("usr/share/doc/debian-history/docs/*.en.html", "html"),)),
    Source("harden-doc", "3.19+nmu1",
           "77ffacb6f8af4afbdf39f3de6040a710ae6ffcc40e2fab5b5d312dfb11d28d94",
           "GPL-2+",
           (("usr/share/doc/harden-doc/html/en-US/*.html", "html"),)),
    Source("gnu-standards", "2022.03.23-0.1",
           "2087dda531c69d8505856a45e0334746f3f25211a237c95d375eed13a7d8c201",
           "GFDL-1.3+ (no invariant sections)",
           (("usr/share/doc/gnu-standards/*.html", "html"),)),
    Source("gnome-user-docs", "43.0-2",
           "0d635a840747958ca84da778b40d341f1155603851f922c9a171f5a181d6a39f",
           "CC-BY-SA-3.0",
           (("usr/share/help/C/*.page", "html"),)),
    Source("libreoffice-help-en-us", "4:7.4.7-1+deb12u14",
           "8faa840285734d6cfe1ed25537b48f07e74bd6412e3917bf8e5f8a653f7b3712",
           "MPL-2.0",
           (("usr/share/libreoffice/help/en-US/text/*.html", "html"),)),
    Source("git-doc", "1:2.39.5-0+deb12u3",
           "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec",
           "GPL-2",
           (("usr/share/doc/git-doc/*.html", "html"),), ("*/RelNotes/*",)),
    Source("rust-doc", "1.63.0+dfsg1-2",
           "96ef96fe6df87d939ca713bd7df3d15c2b778ccb892eca025c4ee504146f697b",
           "MIT or Apache-2.0",
           tuple((f"usr/share/doc/rust-doc/html/{book}/*.html", "html") for book in (
               "book", "reference", "nomicon", "rustc", "edition-guide", "rust-by-example",
               "embedded-book", "rustdoc")),
           ("*/print.html", "*/toc.html", "*/404.html")),
    Source("python-django-doc", "3:3.2.25-0+deb12u7",
           "87307f067916df72e17180d35b7cde5c7ea6080336cda518efd7f6e66988a7ca",
           "BSD-3-Clause",
           (("usr/share/doc/python-django-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/py-modindex.html", "*/search.html")),
    Source("python3.11-doc", "3.11.2-6+deb12u9",
           "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
           "PSF-2.0",
           (("usr/share/doc/python3.11/html/*.html", "html"),),
           ("*/_sources/*", "*/genindex*.html", "*/py-modindex.html", "*/search.html",
            "*/whatsnew/changelog.html")),
    Source("postgresql-doc-15", "15.20-0+deb12u1",
           "4c44bf2c599f208b3f46454a6cf7a72e25ec46ff74d37b59dd31ad76b00eebb7",
           "PostgreSQL",
           (("usr/share/doc/postgresql-doc-15/html/*.html", "html"),), ("*/bookindex.html",)),
    Source("linux-doc-6.1", "6.1.192-3",
           "f18dfe28dcab7bdbf9185be16b9521f5841277a6a96c374a6683a648d5d5fa4f",
           "GPL-2.0",
           (("usr/share/doc/linux-doc-6.1/html/*.html", "html"),),
           ("*/_sources/*", "*/translations/*", "*/genindex.html", "*/search.html")),
    Source("perl-doc", "5.36.0-7+deb12u4",
           "f4269cff4576d6f02a6756df842988e58451c7e945b08517dd235531b24e48f8",
           "GPL-1+ or Artistic",
           (("usr/share/perl/5.36.0/pod/*.pod", "pod"),)),
    Source("manpages", "6.03-2",
           "efa1ba4cd19ad7baeae959c9209a7eb74be2ebb858bcabb412597bfc9f588c91",
           "Linux man-pages licences (permissive, per page)",
           (("usr/share/man/man*.gz", "roff"),)),
    Source("manpages-dev", "6.03-2",
           "96f55cb5e26231d5567c89b692bced63825a14a2d5bd18fdf16ea2ed44eb9838",
           "Linux man-pages licences (permissive, per page)",
           (("usr/share/man/man*.gz", "roff"),)),
    Source("zsh-doc", "5.9-4",
           "79bd75df4bf03d1021e993fd773f82b8a4c8d76649e420cd32eca940cf418ff4",
           "MIT-like (zsh)",
           (("usr/share/doc/zsh-common/html/*.html", "html"),)),
    Source("bash-doc", "5.2.15-2",
           "2c1a353f7004d14ba81db19c253b958d2dd9582027650739c530fd50376a9d8b",
           "GFDL-1.3+ (bash reference manual)",
           (("usr/share/doc/bash/bashref.html", "html"),)),
    Source("nodejs-doc", "18.20.4+dfsg-1~deb12u3",
           "d2fbd4f3aecccea9d901a03842ef8380379e0d33010a48af5e797ed68ae874ce",
           "MIT",
           (("usr/share/doc/nodejs/api/*.html", "html"),), ("*/all.html", "*/index.html")),
    Source("sqlite3-doc", "3.40.1-2+deb12u2",
           "466e30d7066e2641fa13e56bc662a2ad521b8cc9c17dde9c9dac3d4f105e32f2",
           "public domain",
           (("usr/share/doc/sqlite3/*.html", "html"),)),
    Source("flex-doc", "2.6.4-8.2",
           "abd9911c21991db1af5afe88313fc13df2018cb8d60b69b8cca20f1f42d04970",
           "BSD-2-Clause (flex)",
           (("usr/share/doc/flex-doc/html/*.html", "html"),)),
    Source("gettext-doc", "0.21-12",
           "223dfc01cf70c03ce1c56bc3acc18a806292cc6af71d5cffcc4674a221ae2bea",
           "GPL-3+ / GFDL",
           (("usr/share/doc/gettext/gettext_*.html", "html"),)),
    Source("autoconf-doc", "2.71-3",
           "99f1cc643908a46068dc17bcbd64dbdcdbdb8c3f67058ae20e8d6b6b26fa7731",
           "GFDL-1.3+",
           (("usr/share/doc/autoconf/autoconf.html", "html"),)),
    Source("guile-3.0-doc", "3.0.8-2",
           "2169d284c252874221e1fe81094de499672606e06210d613d94125c5242c2b95",
           "GFDL-1.3+",
           (("usr/share/info/guile-3.0/*.gz", "info"),)),
    Source("r-doc-info", "4.2.2.20221110-2",
           "622344f981dc6f4fe755311cffe6d6ce7e001bfd7205dbb79e7f8646db91d5d2",
           "GPL-2+ (R manuals)",
           (("usr/share/info/*.gz", "info"),)),
    Source("gimp-help-en", "2.10.34-2",
           "a2deec76763aaf2fcdd197bac0736cdcb0770ba993d48d233329e1c92b0bfe36",
           "GFDL-1.2+",
           (("usr/share/gimp/2.0/help/en/*.html", "html"),)),
    Source("lilypond-doc-html", "2.24.1-2",
           "be9fb743e58bd5ad4710146fe05e7c5f447fe4559e42c6acef1916d53e4bec60",
           "GFDL-1.3+",
           tuple((f"usr/share/doc/lilypond/html/Documentation/{part}/*.html", "html") for part in (
               "learning", "notation", "usage", "extending", "contributor", "essay", "changes",
               "music-glossary")),
           ("*.??.html", "*.??_??.html")),
    Source("apache2-doc", "2.4.71-1~deb12u1",
           "a7b3d1131c1c63dbf9999b28e75f9a133d30f70492b419936bd51759ac77a01f",
           "Apache-2.0",
           (("usr/share/doc/apache2-doc/manual/en/*.html", "html"),)),
    Source("exim4-doc-html", "4.96-1",
           "f0613395fd73c3c278b619c8162c5a183e7874cbfdebe3614b4b3339d5d8a120",
           "GPL-2+",
           (("usr/share/doc/exim4-doc-html/spec_html/*.html", "html"),)),
    Source("bind9-doc", "1:9.18.49-1~deb12u3",
           "7a3282f365576e58378b242ea7e8bd65ce227e94dd4abe8acbb5874873e7265e",
           "MPL-2.0",
           (("usr/share/doc/bind9-doc/arm/*.html", "html"),),
           ("*/genindex.html", "*/search.html")),
    Source("erlang-doc", "1:25.2.3+dfsg-1+deb12u4",
           "7d172cecfdd9c2930b27c776ad226ffcc84670375cf830c79ee41c6944e8a1c8",
           "Apache-2.0",
           (("usr/share/doc/erlang-doc/*.html", "html"),),
           ("*/wx-*", "*/jinterface-*")),
    Source("python-pandas-doc", "1.5.3+dfsg-2",
           "4998405ff6b12432f46594963e95554ade1104705795428396345fca58d853f8",
           "BSD-3-Clause",
           (("usr/share/doc/python-pandas-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/generated/*", "*/genindex.html", "*/search.html")),
    Source("python-sklearn-doc", "1.2.1+dfsg-1",
           "4e244556326064e87e7563e3e544c2288d44b5719db2d7b3a85c9a84ae93488d",
           "BSD-3-Clause",
           (("usr/share/doc/python-sklearn-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/auto_examples/*", "*/genindex.html", "*/search.html")),
    Source("ghc-doc", "9.0.2-4",
           "a7c77e36c8906f82eef411ceeba13b7d663b7766a5ecc6659e3405889e0429c9",
           "BSD-3-Clause (GHC)",
           (("usr/share/doc/ghc-doc/html/users_guide/*.html", "html"),
            ("usr/share/doc/ghc-doc/html/libraries/*.html", "html")),
           ("*/genindex.html", "*/search.html", "*/src/*", "*/doc-index*")),
    Source("octave-doc", "7.3.0-2",
           "b27897cc7e3d688daa5cb8f8d1ea47077f3fbd205ce32e22522200ff0c1eadd5",
           "GPL-3+",
           (("usr/share/doc/octave/octave.html/*.html", "html"),)),
    Source("maxima-doc", "5.46.0-11",
           "01a726b693a7e465a62040ac5ade4762194d7553524231d77cd1fcd4a69a75b9",
           "GPL-2",
           (("usr/share/doc/maxima-doc/html/*.html", "html"),)),
    Source("debian-edu-doc-en", "2.12.23~deb12u1",
           "0a985aebd07dd69ea1d22c767c410fbca429e7c9fa378024bcaf4fedeb09506a",
           "GPL-2+",
           (("usr/share/doc/debian-edu-doc-en/*.html", "html"),)),
    Source("installation-guide-amd64", "20230508+deb12u1",
           "812c43e1dc906daf671e3efe953dc023205c238e5bd5a3021ce4ca142793573a",
           "GPL-2",
           (("usr/share/doc/installation-guide-amd64/en/*.html", "html"),)),
    Source("gnome-devel-docs", "40.3-1",
           "6089362d009f1c38b406fdf88da24d69965eaa5756097c50e0954bba5312bfbc",
           "CC-BY-SA-3.0",
           (("usr/share/help/C/*.page", "html"),)),
    Source("sphinx-doc", "5.3.0-4",
           "1da3d08bb3a0bc82a4b8b8109410e223054bf5fb13904557ec8ea869046f65b4",
           "BSD-2-Clause",
           (("usr/share/doc/sphinx-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/search.html")),
    Source("python-sympy-doc", "1.11.1-1",
           "2a1d50bd49738f0280308fc8d86d5fa5739dbc6391e1c754f4549bc3635e6a31",
           "BSD-3-Clause",
           (("usr/share/doc/python-sympy-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/search.html")),
    Source("python-astropy-doc", "5.2.1-2+deb12u1",
           "d7cfa77ec5239a4ebcdf27c7cdc3d9e604228e99257f91d4260abbb970469b91",
           "BSD-3-Clause",
           (("usr/share/doc/python-astropy-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/search.html")),
    Source("python-scipy-doc", "1.10.1-2",
           "a237fdcef1675622f1a5d8a291c64feba140615130ee625554f94772d4ea3ad7",
           "BSD-3-Clause",
           (("usr/share/doc/python-scipy-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/search.html")),
    Source("kicad-doc-en", "6.0.11+dfsg-1",
           "20dbe9acb2e6f38d49bd742d4b71bee2dc3e7dbd8c54a7a45ad05a742e5ae834",
           "GPL-3+ or CC-BY-3.0",
           (("usr/share/doc/kicad/help/en/*.html", "html"),)),
    Source("python-flask-doc", "2.2.2-3",
           "0659f6a04b15fe3f907150cadc0399fe987c790e722e001b73f7e49fa5ecca15",
           "BSD-3-Clause",
           (("usr/share/doc/python-flask-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/search.html")),
    Source("cmake-doc", "3.25.1-1",
           "6e805a758ffed87cc7ea234cf0a7a1bb8ae78b93d8b5783e7fb989a6320f8133",
           "BSD-3-Clause",
           (("usr/share/doc/cmake-data/html/*.html", "html"),),
           ("*/_sources/*", "*/genindex.html", "*/search.html")),
    Source("llvm-14-doc", "1:14.0.6-12",
           "d83d576ccf39dd9c698f983677f5569284cb4d55f084dd135859a73d31910b1a",
           "Apache-2.0 WITH LLVM-exception",
           (("usr/share/doc/llvm-14-doc/html/*.html", "html"),),
           ("*/AMDGPU/*", "*/_sources/*", "*/genindex.html", "*/search.html")),
    Source("clang-14-doc", "1:14.0.6-12",
           "9d4160c5cdb3e240fc676eacba163481002363f9532f854bc09e3eb566eb5c0f",
           "Apache-2.0 WITH LLVM-exception",
           (("usr/share/doc/clang-14/html/*.html", "html"),),
           ("*/_sources/*", "*/genindex.html", "*/search.html")),
    Source("qtbase5-doc-html", "5.15.8+dfsg-11+deb12u3",
           "e052497a7db970f002807e3543043c11e46135641b8284b0a419086ba64f5f47",
           "GFDL-1.3 (Qt documentation)",
           (("usr/share/qt5/doc/*.html", "html"),),
           ("*-members.html", "*-obsolete.html")),
    Source("libboost1.74-doc", "1.74.0+ds1-21",
           "10a7c2aa42068bcb71093fc375bf3a9ef2235baa91cc4960aa0c02df3c733d4a",
           "BSL-1.0",
           (("usr/share/doc/libboost1.74-doc/*.html", "html"),)),
    Source("racket-doc", "8.7+dfsg1-1",
           "d50139b4bf806cd280bd18146ca2e7579cede5da23cc7f5c663044596af4e00f",
           "Apache-2.0 or MIT",
           (("usr/share/doc/racket/*.html", "html"),),
           ("*/deinprogramm/*", "*/search/*")),
    Source("gnucash-docs", "4.13-1",
           "09979baf0ff8ddc1f9c39320c2c38ff606d6f4656e04742ff2dc51f2d562996f",
           "GFDL-1.1+",
           (("usr/share/doc/gnucash-docs/gnucash-guide-en/*.html", "html"),
            ("usr/share/doc/gnucash-docs/gnucash-help-en/*.html", "html"))),
    Source("openjdk-17-doc", "17.0.21.1+2-1~deb12u1",
           "3e04db24dbcb31d598774973998f1d8212e3424e288befbfef235077325f841d",
           "GPL-2 WITH Classpath-exception-2.0",
           (("usr/share/doc/openjdk-17-jre-headless/api/*.html", "html"),),
           ("*/class-use/*", "*/index-files/*", "*-tree.html", "*/package-use.html",
            "*/allclasses*", "*/allpackages*", "*/overview-*", "*/serialized-form.html",
            "*/search.html", "*/constant-values.html", "*/deprecated-list.html")),
    Source("libgtk-3-doc", "3.24.38-2~deb12u3",
           "50576efbab6f45f001295279b41aa26526c441b2f7b0365ee1e17f3a46f45f78",
           "LGPL-2.1+",
           (("usr/share/gtk-doc/html/*.html", "html"),)),
    Source("python-jinja2-doc", "3.1.2-1+deb12u3",
           "97b16e94881ccedd65c2b3b100497785089a4981cbcffcb03347e27b3d247931",
           "BSD-3-Clause",
           (("usr/share/doc/python-jinja2-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/search.html")),
    Source("python-setuptools-doc", "66.1.1-1+deb12u2",
           "3592631a1b7f7df5762abf5eeb1d7bba4390f3b7667574552927f71e30a3eabd",
           "MIT",
           (("usr/share/doc/python-setuptools-doc/html/*.html", "html"),),
           ("*/_modules/*", "*/genindex.html", "*/search.html")),
    Source("libglib2.0-doc", "2.74.6-2+deb12u9",
           "87a273d34af94a439764cf63fc81188f2527ae3280c29df58a907b33318eb8bc",
           "LGPL-2.1+",
           (("usr/share/gtk-doc/html/*.html", "html"),)),
)
"""Every source, in output order. Versions are Debian 12 (bookworm) main."""


class BuildError(Exception):
    """A bad input or a failed download: reported as one line by the CLI."""


# ----------------------------------------------------------------------------- reading
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


# ----------------------------------------------------------------------------- markup
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


# ----------------------------------------------------------------------------- filters
MIN_PARAGRAPH_WORDS = 8
MAX_CODE_SYMBOLS = 0.04
MIN_WORD_FRACTION = 0.7
MAX_UPPER_FRACTION = 0.25
MIN_DOCUMENT_WORDS = 80
MIN_STOPWORD_FRACTION = 0.15
BOILERPLATE_DOCUMENTS = 3
NEAR_DUPLICATE_CONTAINMENT = 0.8
_CODE_CHARS = set("{}[]<>=;|\\$#@~^`_*")
_WORD = re.compile(r"^[\"'(\[\u201c\u2018]*(?:[A-Za-z][a-z]*|[A-Z]+)(?:['\u2019-][A-Za-z]+)*"
                   r"[.,;:!?)\"'\]\u201d\u2019]*$")
_SENTENCE_END = re.compile(r"[A-Za-z0-9)\"'\u201d\u2019][.!?][\"')\u201d\u2019]?(?:\s|$)")
_STOPWORDS = frozenset("the of and to a in is that it for as with be on this are by or not an "
                       "can from if you which will at".split())
PARAGRAPH_RULES = ("too_short", "code_symbols", "not_words", "no_sentence", "upper_case")


def paragraph_verdict(para: str) -> str | None:
    """The first prose rule that ``para`` (whitespace-normalised) fails, or None.

    Rules: at least :data:`MIN_PARAGRAPH_WORDS` words; at most :data:`MAX_CODE_SYMBOLS` of
    its non-space characters from ``{}[]<>=;|\\$#@~^`_*``; at least :data:`MIN_WORD_FRACTION`
    of its words plain words (letters, inner apostrophes or hyphens, edge punctuation);
    a sentence end (``.``, ``!``, ``?``); at most :data:`MAX_UPPER_FRACTION` capitals.
    """
    words = para.split()
    if len(words) < MIN_PARAGRAPH_WORDS:
        return "too_short"
    chars = [c for c in para if not c.isspace()]
    if sum(c in _CODE_CHARS for c in chars) > MAX_CODE_SYMBOLS * len(chars):
        return "code_symbols"
    if sum(bool(_WORD.match(w)) for w in words) < MIN_WORD_FRACTION * len(words):
        return "not_words"
    if not _SENTENCE_END.search(para):
        return "no_sentence"
    letters = [c for c in para if c.isalpha()]
    if sum(c.isupper() for c in letters) > MAX_UPPER_FRACTION * len(letters):
        return "upper_case"
    return None


def normalise(para: str) -> str:
    """One line: whitespace runs (no-break spaces included) become one space."""
    return " ".join(para.replace("\u00a0", " ").replace("\u00b6", "").split())


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


def _fingerprints(text: str) -> set[int]:
    words = re.findall(r"\w+", text.lower())
    shingles = (" ".join(words[i:i + 5]) for i in range(max(len(words) - 4, 1)))
    return {h for h in (zlib.crc32(s.encode()) for s in shingles) if h % 8 == 0}


def near_duplicates(texts: Sequence[str]) -> set[int]:
    """Indices of documents whose sampled 5-word shingles are at least
    :data:`NEAR_DUPLICATE_CONTAINMENT` contained in one larger kept document (largest
    first, ties by index: deterministic)."""
    prints = [_fingerprints(t) for t in texts]
    index: dict[int, list[int]] = defaultdict(list)
    dropped = set()
    for i in sorted(range(len(texts)), key=lambda i: (-len(prints[i]), i)):
        fp = prints[i]
        if len(fp) >= 4:
            hits = Counter(j for h in fp for j in index.get(h, ()) if len(index[h]) <= 64)
            if hits and hits.most_common(1)[0][1] >= NEAR_DUPLICATE_CONTAINMENT * len(fp):
                dropped.add(i)
                continue
        for h in fp:
            index[h].append(i)
    return dropped


def clean_documents(docs: Sequence[tuple[str, str, list[str]]], counts: Counter
                    ) -> list[tuple[str, str, str]]:
    """Documents without prose, exact duplicates, boilerplate paragraphs, short or
    non-English documents and near duplicates removed from ``(source, path, paragraphs)``,
    in that order; returns ``(source, path, text)`` in input order. ``counts`` gets one entry per removal reason.

    A paragraph is boilerplate when it appears in at least :data:`BOILERPLATE_DOCUMENTS`
    distinct documents (navigation, licence blurbs, generated notes).
    """
    unique, hashes = [], set()
    for source, path, paras in docs:
        if not paras:
            counts["no_prose"] += 1
            continue
        digest = hashlib.sha256("\n\n".join(paras).encode()).digest()
        if digest in hashes:
            counts["exact_duplicate"] += 1
            continue
        hashes.add(digest)
        unique.append((source, path, paras))
    seen_in = Counter(p for _, _, paras in unique for p in set(paras))
    boiler = {p for p, n in seen_in.items() if n >= BOILERPLATE_DOCUMENTS}
    texts = []
    for source, path, paras in unique:
        kept = [p for p in paras if p not in boiler]
        counts["boilerplate_paragraphs"] += len(paras) - len(kept)
        words = " ".join(kept).split()
        if len(words) < MIN_DOCUMENT_WORDS:
            counts["too_short"] += 1
            continue
        if sum(w.lower() in _STOPWORDS for w in words) < MIN_STOPWORD_FRACTION * len(words):
            counts["not_english"] += 1
            continue
        texts.append((source, path, "\n\n".join(kept)))
    near = near_duplicates([t for _, _, t in texts])
    counts["near_duplicate"] += len(near)
    return [t for i, t in enumerate(texts) if i not in near]


# ----------------------------------------------------------------------------- building
def fetch(source: Source, debs: Path, download: bool) -> Path:
    """The source's ``.deb`` in ``debs`` (downloaded with ``apt-get download`` when missing
    and ``download``), its digest checked against the pin."""
    # apt writes an epoch "1:" as "1%3a"; other tools drop it
    names = {source.version.replace(":", "%3a"), source.version.split(":", 1)[-1]}

    def matches() -> list[Path]:
        return sorted(p for v in names for p in debs.glob(f"{source.package}_{v}_*.deb"))

    found = matches() if debs.is_dir() else []
    if not found and download:
        debs.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["apt-get", "download", f"{source.package}={source.version}"],
                             cwd=debs, capture_output=True, text=True)
        found = matches()
        if res.returncode != 0 or not found:
            why = (res.stderr.strip().splitlines() or ["no file written"])[-1]
            raise BuildError(f"apt-get download {source.package}={source.version} failed "
                             f"({why}); put the .deb in {debs} (--debs) or pass --no-download")
    if not found:
        raise BuildError(f"no {source.package} {source.version} .deb in {debs}")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if source.sha256 is not None and digest != source.sha256:
        raise BuildError(f"{found[0].name}: sha256 {digest[:12]}... differs from the pinned "
                         f"{source.sha256[:12]}...")
    return found[0]


def _convert_task(task: tuple[str, str, str, bytes]) -> tuple[str, str, list[str] | None, Counter]:
    package, path, fmt, raw = task
    counts: Counter = Counter()
    return package, path, convert(fmt, raw, counts), counts


def _tasks(sources: Sequence[Source], debs: Path, download: bool, stats: dict
           ) -> Iterator[tuple[str, str, str, bytes]]:
    for source in sources:
        deb = fetch(source, debs, download)
        raw_deb = deb.read_bytes()
        entry = stats[source.package]
        entry.update(version=source.version, licence=source.licence, deb=deb.name,
                     deb_sha256=hashlib.sha256(raw_deb).hexdigest())
        members = sorted(deb_members(raw_deb, lambda p: select(source, p) is not None))
        entry["files_read"] = len(members)
        for path, raw in members:
            yield source.package, path, select(source, path), raw


def build(sources: Sequence[Source], debs: Path, out: Path, *, download: bool = True,
          jobs: int = 1, progress: bool = False) -> dict:
    """Convert, filter and deduplicate ``sources``; write ``out/prose.jsonl`` and
    ``out/prose.jsonl.gz``; return the manifest (without the tokenizer part).

    Args:
        sources: packages in output order.
        debs: folder holding (or receiving) the ``.deb`` files.
        out: output folder (created).
        download: fetch missing packages with ``apt-get download``.
        jobs: conversion processes (1: in this process).
        progress: a tqdm bar over files on stderr.

    Returns:
        The manifest: per-source counts, filter counts and output digests.
    """
    stats: dict = defaultdict(dict)
    para_counts: Counter = Counter()
    doc_counts: Counter = Counter()
    docs = []
    tasks = _tasks(sources, debs, download, stats)
    if jobs > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(jobs)
        results: Iterable = pool.imap(_convert_task, tasks, chunksize=8)
    else:
        pool, results = None, map(_convert_task, tasks)
    if progress:
        from tqdm import tqdm

        results = tqdm(results, unit="file", desc="converting", dynamic_ncols=True)
    try:
        for package, path, paras, counts in results:
            para_counts.update(counts)
            doc_counts["files"] += 1
            if paras is None:
                doc_counts["not_utf8"] += 1
            else:
                docs.append((package, path, paras))
    finally:
        if pool is not None:
            pool.terminate()
    kept = clean_documents(docs, doc_counts)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "prose.jsonl"
    with open(jsonl, "wb") as f:
        for package, path, text in kept:
            f.write(json.dumps({"text": text, "source": package, "path": path},
                               ensure_ascii=False).encode() + b"\n")
            entry = stats[package]
            entry["documents"] = entry.get("documents", 0) + 1
            entry["bytes"] = entry.get("bytes", 0) + len(text.encode())
            entry["words"] = entry.get("words", 0) + len(text.split())
    raw = jsonl.read_bytes()
    with open(out / "prose.jsonl.gz", "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as gz:
            gz.write(raw)
    doc_keys = ("files", "not_utf8", "no_prose", "exact_duplicate", "boilerplate_paragraphs",
                "too_short", "not_english", "near_duplicate")
    return {
        "format": FORMAT_VERSION,
        "sources": {s.package: {"documents": 0, "bytes": 0, "words": 0, **stats[s.package]}
                    for s in sources},
        "filters": {
            "paragraph_rules": {
                "min_words": MIN_PARAGRAPH_WORDS, "max_code_symbols": MAX_CODE_SYMBOLS,
                "min_word_fraction": MIN_WORD_FRACTION, "max_upper_fraction": MAX_UPPER_FRACTION,
                "boilerplate_documents": BOILERPLATE_DOCUMENTS},
            "document_rules": {
                "min_words": MIN_DOCUMENT_WORDS, "min_stopword_fraction": MIN_STOPWORD_FRACTION,
                "near_duplicate_containment": NEAR_DUPLICATE_CONTAINMENT,
                "near_duplicate_shingles": "5 words, crc32 % 8 == 0 sample"},
            "paragraphs": {k: para_counts[k] for k in ("read", "kept", *PARAGRAPH_RULES)},
            "documents": {**{k: doc_counts[k] for k in doc_keys}, "kept": len(kept)},
        },
        "output": {
            "jsonl": jsonl.name, "documents": len(kept), "bytes": len(raw),
            "text_bytes": sum(e.get("bytes", 0) for e in stats.values()),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "gz": "prose.jsonl.gz",
            "gz_sha256": hashlib.sha256((out / "prose.jsonl.gz").read_bytes()).hexdigest(),
        },
    }


def train_tokenizer(out: Path, vocab_size: int, manifest: dict, progress: bool) -> None:
    """Train the byte-level BPE tokenizer on ``out/prose.jsonl`` into ``out/tokenizer``
    (the project's trainer) and add token counts per source to ``manifest``."""
    from megatron_lrattn.data.tokenizer import HFTokenizer, train_bpe_tokenizer

    with open(out / "prose.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    train_bpe_tokenizer((r["text"] for r in rows), out / "tokenizer", vocab_size,
                        length=len(rows))
    tok = HFTokenizer(out / "tokenizer")
    per_source: Counter = Counter()
    chunks: Iterable = range(0, len(rows), 256)
    if progress:
        from tqdm import tqdm

        chunks = tqdm(chunks, unit="chunk", desc="counting tokens", dynamic_ncols=True)
    for i in chunks:
        batch = rows[i:i + 256]
        for r, ids in zip(batch, tok.tokenize_batch([r["text"] for r in batch])):
            per_source[r["source"]] += len(ids)
    for package, entry in manifest["sources"].items():
        entry["tokens"] = per_source[package]
    manifest["tokenizer"] = {
        "folder": "tokenizer", "vocab_size": tok.vocab_size,
        "sha256": hashlib.sha256((out / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest(),
        "tokens": sum(per_source.values()),
        "tokens_with_eod": sum(per_source.values()) + len(rows),
    }


# ----------------------------------------------------------------------------- CLI
def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tools/build_prose_corpus.py``."""
    p = argparse.ArgumentParser(prog="build_prose_corpus", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("data/prose"),
                   help="output folder: prose.jsonl(.gz), manifest.json, tokenizer/ "
                        "(default: data/prose)")
    p.add_argument("--debs", type=Path, default=None,
                   help="folder of the .deb files, filled by apt-get download when missing "
                        "(default: OUT/debs)")
    p.add_argument("--sources", default=None,
                   help="comma-separated package names to build from (default: every source)")
    p.add_argument("--no-download", action="store_true", help="never run apt-get download")
    p.add_argument("--vocab-size", type=_count, default=8192,
                   help="train a byte-level BPE tokenizer of this size on the corpus and count "
                        "tokens per source (0: no tokenizer; default 8192)")
    p.add_argument("--jobs", type=_count, default=1, help="conversion processes (default 1)")
    p.add_argument("--list", action="store_true", help="print the sources and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 on bad flags or inputs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for s in SOURCES:
            print(f"{s.package}={s.version}\t{s.licence}")
        return 0

    def fail(message: str) -> None:
        parser.exit(2, f"build_prose_corpus: error: {message}\n")

    sources = list(SOURCES)
    if args.sources is not None:
        names = [n.strip() for n in args.sources.split(",") if n.strip()]
        known = {s.package: s for s in SOURCES}
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            fail(f"unknown source(s) {', '.join(unknown) or '(none given)'}; see --list")
        sources = [known[n] for n in names]
    if args.vocab_size and args.vocab_size < 258:
        fail("--vocab-size must be 0 or >= 258 (256 bytes and the end-of-document token)")
    if args.jobs < 1:
        fail("--jobs must be >= 1")
    if args.out.exists() and not args.out.is_dir():
        fail(f"--out {args.out} is not a folder")
    if args.debs is not None and args.debs.exists() and not args.debs.is_dir():
        fail(f"--debs {args.debs} is not a folder")
    if args.debs is not None and not args.debs.exists() and args.no_download:
        fail(f"--debs {args.debs} is not a folder (and --no-download)")
    debs = args.debs if args.debs is not None else args.out / "debs"
    try:
        manifest = build(sources, debs, args.out, download=not args.no_download,
                         jobs=args.jobs, progress=not args.no_progress)
        if args.vocab_size:
            train_tokenizer(args.out, args.vocab_size, manifest, not args.no_progress)
    except (BuildError, OSError, tarfile.TarError, lzma.LZMAError, EOFError) as err:
        print(f"build_prose_corpus: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("build_prose_corpus: interrupted", file=sys.stderr)
        return 130
    manifest["command"] = "python tools/build_prose_corpus.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    o = manifest["output"]
    print(f"{o['documents']} documents, {o['text_bytes'] / 1e6:.1f} MB of text"
          + (f", {manifest['tokenizer']['tokens']:,} tokens" if "tokenizer" in manifest else "")
          + f" -> {args.out / o['jsonl']} (sha256 {o['sha256'][:16]}...)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
