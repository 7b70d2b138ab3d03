"""The network files Great Expectations' Data Docs load, and the installed PyPI packages that ship a copy of each.

GX's page templates load bootstrap, jQuery, popper, bootstrap-table, bootstrap-datepicker, Font Awesome and
vega/vega-lite/vega-embed from CDNs. On an air-gapped cluster those loads fail and the report renders unstyled,
with unsortable tables and empty charts, so tasks/data/offline_docs.py replaces every such address with a copy
taken from a package that `make setup` installs (the set-up time is the only time anything is downloaded).
Files are found through package metadata, never by importing the package (Bootstrap-Flask 1.2 imports
flask.Markup, which Flask 3 removed; panel needs bokeh; both are installed without their dependencies).

Where no package ships GX's exact version the closest one that does is used; the comments say which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.common.assets import installed_file


class DocsAssetMissing(RuntimeError):
    """A package that ships a Data Docs asset is not installed; the message holds the exact install command."""


@dataclass(frozen=True)
class DocsAsset:
    """One CDN address of GX's templates and its local copy.

    `file` (under `package_root` of the installed `distribution`) replaces `url`; `companions` are the files or
    folders under `package_root` that `file` itself loads by relative path (Font Awesome's webfonts). Everything is
    copied under `static/vendor/<local_dir>/` of the site with its layout under `package_root` kept, and
    `local_name` renames `file` there (panel ships vega as `vega@5`, without an extension).
    """

    url: str
    distribution: str
    version: str
    package_root: str
    file: str
    local_dir: str
    companions: tuple[str, ...] = ()
    local_name: str = ""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"

    @property
    def local_file(self) -> str:
        """The copy's path under the site's `static/vendor/`."""
        return f"{self.local_dir}/{self.local_name or self.file}"

    def source(self, relative: str) -> Path:
        """The installed path of `relative` (a file or folder under `package_root`), or DocsAssetMissing."""
        located = installed_file(self.distribution, f"{self.package_root}/{relative}")
        if located is None:
            raise DocsAssetMissing(
                f"Data Docs asset {self.url} is copied from the package {self.distribution}, which is not "
                f"installed; install it with: {self.install_command} (or run `make setup`)"
            )
        path, version = located
        if not path.exists():
            raise DocsAssetMissing(
                f"Data Docs asset {self.url}: {self.package_root}/{relative} is missing from {self.distribution} "
                f"{version}; install the version that ships it with: {self.install_command}"
            )
        return path


BOOTSTRAP_FLASK = ("Bootstrap-Flask", "1.2.0", "flask_bootstrap/static")  # Bootstrap 4.3.1, popper.js 1.14.0
BOOTSTRAP_TABLE = ("kotti_bstable", "1.0.2", "kotti_bstable/static/ext/bootstrap-table/dist")  # bootstrap-table 1.11.1
DATEPICKER = ("kotti_bstable", "1.0.2", "kotti_bstable/static/ext/bootstrap-datepicker/dist")  # datepicker 1.9.0
PANEL = ("panel", "1.6.3", "panel/dist/bundled/vegaplot")  # vega 5.33.0, vega-lite 5.23.0, vega-embed 6.29.0
FONT_AWESOME = ("XStatic-Font-Awesome", "6.2.1.2", "xstatic/pkg/font_awesome/data")  # Font Awesome 6.2.1
JQUERY = ("XStatic-jQuery", "3.7.1.1", "xstatic/pkg/jquery/data")  # jQuery 3.7.1

FILTER_CONTROL = "extensions/filter-control"

#: Every CDN address GX 1.x's Data Docs templates load (render/view/templates/*.j2), keyed by address.
DOCS_ASSETS: dict[str, DocsAsset] = {asset.url: asset for asset in [
    DocsAsset("https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css", *BOOTSTRAP_FLASK,
              "css/bootstrap.min.css", "bootstrap"),
    DocsAsset("https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js", *BOOTSTRAP_FLASK,
              "js/bootstrap.min.js", "bootstrap"),
    # GX asks for popper.js 1.12.9; Bootstrap-Flask ships 1.14.0 (Bootstrap 4.3.1's own pairing).
    DocsAsset("https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js", *BOOTSTRAP_FLASK,
              "popper.min.js", "popper"),
    DocsAsset("https://code.jquery.com/jquery-3.7.1.min.js", *JQUERY, "jquery.min.js", "jquery"),
    # GX asks for Font Awesome 6.6.0; XStatic ships 6.2.1, which has every icon the templates use.
    DocsAsset("https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css", *FONT_AWESOME,
              "css/all.min.css", "font-awesome", companions=("webfonts",)),
    # GX asks for bootstrap-table 1.19.1 (filter-control 1.19.0/1.19.1); the only PyPI package that ships
    # bootstrap-table at all ships 1.11.1 (sorting, search and the filter-control extension work with it).
    DocsAsset("https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css", *BOOTSTRAP_TABLE,
              "bootstrap-table.min.css", "bootstrap-table"),
    DocsAsset("https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js", *BOOTSTRAP_TABLE,
              "bootstrap-table.min.js", "bootstrap-table"),
    DocsAsset("https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/"
              "bootstrap-table-filter-control.min.js", *BOOTSTRAP_TABLE,
              f"{FILTER_CONTROL}/bootstrap-table-filter-control.min.js", "bootstrap-table"),
    # 1.11.1 has no minified filter-control stylesheet: both of GX's addresses get the plain one.
    DocsAsset("https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
              "bootstrap-table-filter-control.css", *BOOTSTRAP_TABLE,
              f"{FILTER_CONTROL}/bootstrap-table-filter-control.css", "bootstrap-table"),
    DocsAsset("https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
              "bootstrap-table-filter-control.min.css", *BOOTSTRAP_TABLE,
              f"{FILTER_CONTROL}/bootstrap-table-filter-control.css", "bootstrap-table"),
    DocsAsset("https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/bootstrap-datepicker.min.css",
              *DATEPICKER, "css/bootstrap-datepicker.min.css", "bootstrap-datepicker"),
    DocsAsset("https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/bootstrap-datepicker.min.js",
              *DATEPICKER, "js/bootstrap-datepicker.min.js", "bootstrap-datepicker"),
    # GX asks for the newest vega 5 / vega-lite 5 / vega-embed 6 (a major-version range): panel 1.6.3 bundles the
    # newest of each line.
    DocsAsset("https://cdn.jsdelivr.net/npm/vega@5", *PANEL, "vega@5", "vega", local_name="vega.js"),
    DocsAsset("https://cdn.jsdelivr.net/npm/vega-lite@5", *PANEL, "vega-lite@5", "vega", local_name="vega-lite.js"),
    DocsAsset("https://cdn.jsdelivr.net/npm/vega-embed@6", *PANEL, "vega-embed@6", "vega",
              local_name="vega-embed.js"),
]}

#: GX images its templates load from its S3 bucket, replaced by the copies GX itself writes into the site's
#: `static/images/` (the dark-mode logo has no local copy: the light one stands in).
SITE_IMAGES: dict[str, str] = {
    "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/logo-long.png": "static/images/logo-long.png",
    "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/full_logo_dark.png":
        "static/images/logo-long.png",
}

#: Stylesheets that are left out offline, with why: no package ships them.
DROPPED: dict[str, str] = {
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/bootstrap-prefers-dark.css":
        "no PyPI package ships bootstrap-dark's dark colour scheme: offline, the pages keep the light theme",
}
