"""The docs stay a reference a newcomer can walk into: a short README, an
architecture page that is not a lab notebook, links that lead somewhere, and
measurements kept as dated entries, one file per benchmark, newest first."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MEASUREMENTS = DOCS / "measurements"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(MEASUREMENTS.glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_readme_is_a_front_door():
    assert lines(ROOT / "README.md") <= 200


def test_the_architecture_page_is_a_reference_not_a_notebook():
    assert lines(DOCS / "architecture.md") < 800


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing paths: {missing}"


def test_the_link_check_sees_a_broken_link(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("[here](here.md) [there](https://example.com) ![x](img.png)\n```\n[in code](nowhere.md)\n```\n")
    (tmp_path / "here.md").write_text("")
    assert relative_links(page) == ["here.md", "img.png"]


@pytest.mark.parametrize("page", sorted(MEASUREMENTS.glob("*.md")), ids=lambda p: p.name)
def test_each_measurements_file_holds_dated_entries_newest_first(page: Path):
    text = page.read_text()
    assert text.startswith("# "), f"{page.name} starts with its title"
    entry_dates = [DATE.search(h).group() for h in re.findall(r"^## .*$", text, re.M) if DATE.search(h)]
    assert entry_dates, f"{page.name} has no dated '## ' entry"
    assert entry_dates == sorted(entry_dates, reverse=True), f"{page.name}: entries are not newest first"


def documented_keys(page: Path) -> set[str]:
    """`section.key` of every row of the page's key tables; a bare `key` after a
    `section.key` in the same first cell is of that section."""
    keys = set()
    for row in page.read_text().splitlines():
        if not row.startswith("| `"):
            continue
        section = None
        for name in re.findall(r"`([a-z_.]+)`", row.split("|")[1]):
            if "." in name:
                section = name.split(".")[0]
            keys.add(name if "." in name or section is None else f"{section}.{name}")
    return keys


def test_configuration_md_lists_every_key_of_every_service():
    from gateway.config import GatewayConfig
    from llm_engine.config import EngineConfig
    from vision_encoder.config import EncoderConfig

    documented = documented_keys(DOCS / "configuration.md")
    keys = {f"{section}.{name}" for section, config in (("gateway", GatewayConfig), ("encoder", EncoderConfig), ("engine", EngineConfig))
            for name in config.model_fields if name != "model" and not name.startswith("test_")}  # `model` is shared; test_* are hooks
    assert not keys - documented, f"keys missing from docs/configuration.md: {sorted(keys - documented)}"
    assert not {k for k in documented if k.split(".")[0] in ("gateway", "encoder", "engine")} - keys, "documented keys no service has"
