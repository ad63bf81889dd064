"""The manual: README.md is the front page (small, its links alive), docs/ a MkDocs site that builds strictly.

`mkdocs build --strict` fails on a broken relative link or anchor, on a page missing from mkdocs.yml's nav
(mkdocs.yml sets `validation: omitted_files: warn`, and strict turns warnings into errors) and on a snippet
(`--8<--`) naming a missing file. The last two tests build a copy of the site with one such fault each, so that a
mkdocs.yml that stopped being strict fails here too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

README = REPO / "README.md"
README_MAX_BYTES = 15_000
# [text](target) and ![alt](target); a target ends at whitespace (a title may follow) or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def build(root: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the site at ``root`` (its mkdocs.yml; snippets resolve from ``root``)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not a build problem
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(root / "mkdocs.yml"),
            "--site-dir",
            str(site_dir),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def copy_site(tmp_path: Path) -> Path:
    """A copy of what the build reads: mkdocs.yml, docs/ and the files docs/ includes (deploy/README.md)."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs")
    (root / "deploy").mkdir()
    shutil.copy(REPO / "deploy" / "README.md", root / "deploy" / "README.md")
    return root


def relative_links(markdown: str) -> list[str]:
    """The link targets of ``markdown`` outside code blocks that are files of the repository (no URL, no anchor)."""
    text = FENCE.sub("", markdown)
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, ...; an anchor in the README itself
        targets.append(target.split("#", 1)[0])
    return targets


def test_site_builds_strictly(tmp_path):
    result = build(REPO, tmp_path / "site")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    for page in (
        "index.html",
        "getting-started/index.html",
        "flags/index.html",
        "performance-suite/index.html",
        "deploying/index.html",
        "architecture/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), f"{page} was not built"
    assert (tmp_path / "site" / "img" / "suite.png").is_file()
    # deploy/README.md is included into the Deploying page, not linked to
    assert "ServexTLSCertificateExpiresSoon" in (tmp_path / "site" / "deploying" / "index.html").read_text()


def test_readme_is_the_front_page():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, more than {README_MAX_BYTES}: move text to docs/"
    text = README.read_text(encoding="utf-8")
    # the two commands of the quick start (.ci/run runs the second)
    assert "python3.11 -m venv .venv && .venv/bin/pip install . && .venv/bin/servex" in text
    assert "python3.11 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest" in text


def test_readme_links_point_at_files():
    targets = relative_links(README.read_text(encoding="utf-8"))
    assert targets, "README.md links to nothing"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_relative_links_are_found():
    assert relative_links('[a](docs/a.md#x) ![b](img/b.png "t") [c](https://example.com) [d](#here)') == [
        "docs/a.md",
        "img/b.png",
    ]
    assert relative_links("```sh\n[x](nowhere.md)\n```\n[y](y.md)") == ["y.md"]


def test_strict_build_fails_on_a_broken_link(tmp_path):
    root = copy_site(tmp_path)
    index = root / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + "\nSee [nowhere](no-such-page.md).\n", encoding="utf-8")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0, "a broken relative link did not fail the strict build"
    assert "no-such-page.md" in result.stdout + result.stderr


def test_strict_build_fails_on_a_page_missing_from_nav(tmp_path):
    root = copy_site(tmp_path)
    (root / "docs" / "orphan.md").write_text("# Not in the nav\n", encoding="utf-8")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0, "a page missing from nav did not fail the strict build"
    assert "orphan.md" in result.stdout + result.stderr
