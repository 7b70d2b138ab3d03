"""Make a rendered GX Data Docs site load nothing from the network.

GX writes pages whose <script>, <link> and <img> tags (and CSS url()s) point at CDNs; on an air-gapped cluster
the report then renders unstyled, its tables do not sort and its charts stay empty. After the site is rendered,
`make_offline` copies the files those addresses serve from installed packages (tasks/data/docs_assets.py) into
`static/vendor/` of the site and points every page and stylesheet at them by relative path, so the site works
from a file:// URL or any static file server. An address with no local copy is an error naming the address and
the page: a page is never left half offline.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Iterable

from tasks.common.artifacts import atomic_file
from tasks.data.docs_assets import DOCS_ASSETS, DROPPED, SITE_IMAGES, DocsAsset

VENDOR_DIR = "static/vendor"

#: An address that leaves the site: http(s) or protocol-relative.
NETWORK_ADDRESS = re.compile(r"^\s*(?:https?:)?//", re.IGNORECASE)
#: Opening tags that load a resource (an <a href> is a link the reader follows, not a load).
RESOURCE_TAG = re.compile(r"<(script|link|img|source|iframe|embed|video|audio)\b[^>]*>", re.IGNORECASE)
TAG_ADDRESS = re.compile(r"""\b(?:src|href)\s*=\s*(["'])(.*?)\1""", re.IGNORECASE | re.DOTALL)
#: Subresource-integrity attributes: they pin the CDN file's hash, which a local copy of another version fails.
INTEGRITY_ATTRIBUTE = re.compile(r"""\s+(?:integrity|crossorigin)(?![\w-])(?:\s*=\s*(["']).*?\1)?""",
                                 re.IGNORECASE | re.DOTALL)
CSS_URL = re.compile(r"""url\(\s*(["']?)([^"')]*)\1\s*\)""", re.IGNORECASE)
CSS_IMPORT = re.compile(r"""@import\s+(["'])([^"']*)\1""", re.IGNORECASE)


class OfflineDocsError(RuntimeError):
    """A Data Docs page loads a network address that has no local copy."""


def make_offline(site: Path) -> list[str]:
    """Rewrite every .html and .css file under `site` to local copies of its network assets; returns the
    vendored paths (relative to `site`) that were copied in."""
    needed: dict[str, DocsAsset] = {}
    rewritten: dict[Path, str] = {}
    for path in site_files(site):
        text = path.read_text(encoding="utf-8")
        localised = Localiser(site, path, needed).rewrite(text)
        if localised != text:
            rewritten[path] = localised
    copied = copy_vendor_files(site, needed.values())
    for path, text in rewritten.items():
        with atomic_file(path) as handle:
            handle.write(text)
    check_offline(site)
    return copied


def site_files(site: Path) -> list[Path]:
    """Every page and stylesheet of the site (the vendored files are copies of packages, never rewritten)."""
    vendor = site / VENDOR_DIR
    files = sorted(site.rglob("*.html")) + sorted(site.rglob("*.css"))
    return [path for path in files if vendor not in path.parents]


class Localiser:
    """Rewrites one page or stylesheet: each network address becomes a relative path to its local copy, and the
    assets to copy are collected in `needed`."""

    def __init__(self, site: Path, path: Path, needed: dict[str, DocsAsset]) -> None:
        self.site = site
        self.path = path
        self.needed = needed

    def rewrite(self, text: str) -> str:
        if self.path.suffix == ".html":
            text = RESOURCE_TAG.sub(self.rewrite_tag, text)
        text = CSS_URL.sub(self.rewrite_css_url, text)
        return CSS_IMPORT.sub(self.rewrite_css_import, text)

    def rewrite_tag(self, match: re.Match[str]) -> str:
        tag = match.group(0)
        found = TAG_ADDRESS.search(tag)
        if found is None or not NETWORK_ADDRESS.match(found.group(2)):
            return tag
        address = found.group(2)
        if without_query(address) in DROPPED and match.group(1).lower() == "link":
            return ""
        local = self.local_path(address)
        tag = tag[:found.start(2)] + local + tag[found.end(2):]
        return INTEGRITY_ATTRIBUTE.sub("", tag)

    def rewrite_css_url(self, match: re.Match[str]) -> str:
        address = match.group(2)
        if not NETWORK_ADDRESS.match(address):
            return match.group(0)
        return f"url('{self.local_path(address)}')"

    def rewrite_css_import(self, match: re.Match[str]) -> str:
        address = match.group(2)
        if not NETWORK_ADDRESS.match(address):
            return match.group(0)
        return f"@import '{self.local_path(address)}'"

    def local_path(self, address: str) -> str:
        """The path, relative to this file, of the local copy of `address`; OfflineDocsError when there is none."""
        key = without_query(address)
        if key in DOCS_ASSETS:
            asset = DOCS_ASSETS[key]
            self.needed[key] = asset
            target = self.site / VENDOR_DIR / asset.local_file
        elif key in SITE_IMAGES:
            target = self.site / SITE_IMAGES[key]
            if not target.is_file():
                raise OfflineDocsError(f"{self.path}: loads {address}, whose stand-in {SITE_IMAGES[key]} GX did not "
                                       f"write into the site")
        else:
            raise OfflineDocsError(
                f"{self.path}: loads {address}, which has no local copy; add the package that ships it to "
                f"tasks/data/docs_assets.py (DOCS_ASSETS) so the Data Docs work offline"
            )
        return os.path.relpath(target, self.path.parent).replace(os.sep, "/")


def without_query(address: str) -> str:
    """The address without its query and fragment (GX appends a cache-busting `?d=<time>` to its logo)."""
    return address.strip().split("#", 1)[0].split("?", 1)[0]


def copy_vendor_files(site: Path, assets: Iterable[DocsAsset]) -> list[str]:
    """Copy the installed files of `assets` (and their companion folders) under the site's `static/vendor/`."""
    copied: list[str] = []
    planned: dict[str, Path] = {}
    for asset in assets:
        planned[asset.local_file] = asset.source(asset.file)
        for companion in asset.companions:
            planned[f"{asset.local_dir}/{companion}"] = asset.source(companion)
    for local, source in sorted(planned.items()):
        destination = site / VENDOR_DIR / local
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, destination, dirs_exist_ok=True)
        else:
            shutil.copyfile(source, destination)
        copied.append(f"{VENDOR_DIR}/{local}")
    return copied


def network_references(path: Path) -> list[str]:
    """The network addresses a page or stylesheet still loads (resource tags, CSS url() and @import)."""
    text = path.read_text(encoding="utf-8")
    addresses: list[str] = []
    if path.suffix == ".html":
        for tag in RESOURCE_TAG.finditer(text):
            found = TAG_ADDRESS.search(tag.group(0))
            if found is not None:
                addresses.append(found.group(2))
    addresses += [match.group(2) for match in CSS_URL.finditer(text)]
    addresses += [match.group(2) for match in CSS_IMPORT.finditer(text)]
    return [address for address in addresses if NETWORK_ADDRESS.match(address)]


def check_offline(site: Path) -> None:
    """Raise OfflineDocsError naming each page and address that still loads from the network."""
    left = [f"{path}: {address}" for path in site_files(site) for address in network_references(path)]
    if left:
        raise OfflineDocsError("Data Docs still load from the network:\n- " + "\n- ".join(left))
