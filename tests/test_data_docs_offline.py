"""The validate stage's GX Data Docs load nothing from the network: every CDN asset is a local copy from an installed
package (tasks/data/offline_docs.py), and a headless chromium with the network refused renders them styled and
sortable."""

from __future__ import annotations

import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from headless_chromium import CHROMIUM, HeadlessChromium
from tasks.data.docs_assets import DocsAsset, DocsAssetMissing
from tasks.data.offline_docs import OfflineDocsError, make_offline
from test_validate import chat_hash, clean_records, materialised, prepare  # noqa: F401  (fixtures)

NETWORK = re.compile(r"^\s*(?:https?:)?//", re.IGNORECASE)
CSS_REFERENCE = re.compile(r"""url\(\s*["']?([^"')]*)|@import\s+["']([^"']*)""", re.IGNORECASE)
INDEX_TABLE = "#section-1-content-block-2-1-body-table"
#: GX 1.x's favicon.j2 climbs one folder too few on validation pages: a broken relative link of GX's own (a
#: missing icon, no network load), left as GX writes it.
GX_FAVICON = "static/images/favicon.ico"


@pytest.fixture(scope="module")
def docs_site(tmp_path_factory: pytest.TempPathFactory, materialised: Path, chat_hash: str) -> Path:  # noqa: F811
    """The Data Docs of one clean validate run (three suites: index, suite and validation pages)."""
    from tasks import validate

    cfg = prepare(tmp_path_factory.mktemp("offline-docs"), materialised, clean_records(chat_hash))
    return validate.run(cfg).data_docs_dir


class LoadedAddresses(HTMLParser):
    """What a page loads: the src/href of resource tags, and the url()/@import of its inline CSS."""

    TAGS = {"script": "src", "img": "src", "source": "src", "iframe": "src", "link": "href"}

    def __init__(self) -> None:
        super().__init__()
        self.addresses: list[str] = []
        self.in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if values.get(self.TAGS.get(tag, "")):
            self.addresses.append(values[self.TAGS[tag]] or "")
        self.addresses += css_addresses(values.get("style") or "")
        self.in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self.in_style = False

    def handle_data(self, data: str) -> None:
        if self.in_style:
            self.addresses += css_addresses(data)


def css_addresses(css: str) -> list[str]:
    return [url or imported for url, imported in CSS_REFERENCE.findall(css)]


def loaded_addresses(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".css":
        return css_addresses(text)
    parser = LoadedAddresses()
    parser.feed(text)
    return parser.addresses


def test_no_page_or_stylesheet_loads_from_the_network(docs_site: Path) -> None:
    files = sorted(docs_site.rglob("*.html")) + sorted(docs_site.rglob("*.css"))
    pages = [path for path in files if path.suffix == ".html"]
    assert len(pages) >= 7, "index, three suite pages and three validation pages"
    network, missing, checked = [], [], 0
    for path in files:
        for address in loaded_addresses(path):
            if address.startswith(("data:", "#")) or not address:
                continue
            checked += 1
            if NETWORK.match(address):
                network.append(f"{path.relative_to(docs_site)}: {address}")
            elif address.endswith(GX_FAVICON) and "/validations/" in path.as_posix():
                continue
            elif not (path.parent / address.split("?")[0]).is_file():
                missing.append(f"{path.relative_to(docs_site)}: {address}")
    assert network == [], "pages still load from the network"
    assert missing == [], "relative references to files that are not in the site"
    assert checked >= 15 * len(pages), "every page loads its scripts and stylesheets (nothing was skipped)"
    for page in pages:
        loaded = loaded_addresses(page)
        assert any(address.endswith("static/vendor/bootstrap/css/bootstrap.min.css") for address in loaded), page
        assert not re.search(r"\bintegrity\s*=", page.read_text()), "a CDN file's hash pins no local copy"
    assert (docs_site / "static/vendor/font-awesome/webfonts/fa-solid-900.woff2").is_file(), "the icon font travels too"


def test_an_asset_without_a_local_copy_fails_naming_it_and_the_page(docs_site: Path, tmp_path: Path) -> None:
    copy = tmp_path / "data_docs"
    shutil.copytree(docs_site, copy)
    page = copy / "index.html"
    original = page.read_text()
    planted_tag = '<script src="https://cdn.example.org/chart-lib@2.js"></script>'
    page.write_text(original.replace("</head>", planted_tag + "</head>"))
    planted = page.read_text()

    with pytest.raises(OfflineDocsError) as failure:
        make_offline(copy)
    assert "https://cdn.example.org/chart-lib@2.js" in str(failure.value) and str(page) in str(failure.value)
    assert page.read_text() == planted, "nothing is rewritten when one address cannot be"


def test_a_missing_asset_package_is_named_with_its_install_command() -> None:
    asset = DocsAsset("https://cdn.example.org/x.js", "eaglet-no-such-asset-package", "1.0", "pkg", "x.js", "x")
    with pytest.raises(DocsAssetMissing, match=r"pip install --no-deps eaglet-no-such-asset-package==1\.0"):
        asset.source(asset.file)


# --- in a browser with the network off ----------------------------------------------------------------------

COLUMN_TEXTS = """(() => {
  const table = document.querySelector('%s');
  const heads = [...table.querySelectorAll('thead th')];
  const column = heads.findIndex(th => th.querySelector('.th-inner').textContent.trim() === '%s');
  return [...table.querySelectorAll('tbody tr')].map(row => row.children[column].textContent.trim());
})()"""
CLICK_HEADER = """(() => {
  const heads = [...document.querySelectorAll('%s thead th .th-inner')];
  const head = heads.find(inner => inner.textContent.trim() === '%s');
  head.click();
  return head.className;
})()"""
CELL_PADDING = "getComputedStyle(document.querySelector('%s tbody td')).paddingTop" % INDEX_TABLE
#: The same cell with the browser's own stylesheet only.
DEFAULT_PADDING = """new Promise(resolve => {
  const frame = document.createElement('iframe');
  frame.srcdoc = '<table class="table"><tr><td>cell</td></tr></table>';
  frame.onload = () => resolve(getComputedStyle(frame.contentDocument.querySelector('td')).paddingTop);
  document.body.appendChild(frame);
})"""
LIBRARIES = ("[typeof jQuery, typeof (window.jQuery && jQuery.fn.bootstrapTable), typeof Popper, "
             "typeof vega, typeof vegaLite, typeof vegaEmbed]")
NETWORK_PROBE = "fetch('https://cdn.jsdelivr.net/npm/vega@5').then(() => 'loaded', () => 'refused')"


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="/usr/bin/chromium is not installed (Debian: `make browser-env`, "
                                                   "i.e. apt-get install chromium chromium-driver)")
def test_the_index_page_is_styled_and_sortable_with_the_network_off(docs_site: Path, tmp_path: Path,
                                                                      subprocesses: None) -> None:
    profile = tmp_path / "profile"
    profile.mkdir()
    browser = HeadlessChromium(profile)
    try:
        page = browser.page()
        page.open((docs_site / "index.html").as_uri())
        assert page.failed_loads() == [] and page.script_errors() == []
        assert page.evaluate(NETWORK_PROBE) == "refused", "the browser really has no network"
        assert page.evaluate(LIBRARIES) == ["function", "function", "function", "object", "object", "function"]
        assert page.evaluate("""document.fonts.check('900 16px "Font Awesome 6 Free"')"""), "icon font loaded"

        table_classes = page.evaluate(f"document.querySelector('{INDEX_TABLE}').className").split()
        assert "table" in table_classes, "bootstrap-table set the table up"
        padding, default = page.evaluate(CELL_PADDING), page.evaluate(DEFAULT_PADDING)
        assert float(padding.rstrip("px")) > float(default.rstrip("px")), f"styled cell {padding}, default {default}"

        before = page.evaluate(COLUMN_TEXTS % (INDEX_TABLE, "Expectation Suite"))
        assert len(before) == 3 and before not in (sorted(before), sorted(before, reverse=True))
        assert "sortable" in page.evaluate(CLICK_HEADER % (INDEX_TABLE, "Expectation Suite")).split()
        first = page.evaluate(COLUMN_TEXTS % (INDEX_TABLE, "Expectation Suite"))
        page.evaluate(CLICK_HEADER % (INDEX_TABLE, "Expectation Suite"))
        second = page.evaluate(COLUMN_TEXTS % (INDEX_TABLE, "Expectation Suite"))
        assert first in (sorted(before), sorted(before, reverse=True)), "a header click sorts the rows"
        assert second == first[::-1], "a second click sorts them the other way"
        page.close()
    finally:
        browser.close()
