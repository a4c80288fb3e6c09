"""The HTML reports: self-contained (nothing fetched), well formed, numbers that add up."""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import modelsize
from modelsize.cli import main
from modelsize.report import html

torch = pytest.importorskip("torch")

_VOID = {"meta", "br", "img", "input", "link", "hr", "area", "base", "col", "source"}


class _Checker(HTMLParser):
    """Balanced tags; every external reference collected."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.external: list[str] = []
        self.rects: list[dict[str, str]] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        for key in ("src", "href", "xlink:href", "action"):
            if key in a:
                self.external.append(f"{tag} {key}={a[key]}")
        if tag == "link":
            self.external.append("link")
        if tag == "script":
            self.scripts += 1
        if tag == "rect":
            self.rects.append(a)
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in _VOID:
            self.stack.pop()

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()


def _check(text: str) -> _Checker:
    c = _Checker()
    c.feed(text)
    c.close()
    assert c.stack == ["html"] or c.stack == [], c.stack[-5:]
    assert not c.external, c.external  # works offline: nothing to fetch
    assert "url(" not in text and "@import" not in text and "http://" not in text
    return c


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from modelsize.cli.demo import inspect_section

    out = tmp_path_factory.mktemp("demo")
    inspect_section(out)
    return out


def test_inspect_page(demo: Path, tmp_path: Path, capsys: Any) -> None:
    page = tmp_path / "r.html"
    assert main(["inspect", str(demo / "train.pt"), "--html", str(page)]) == 0
    text = page.read_text()
    c = _check(text)
    report = modelsize.inspect(demo / "train.pt")
    # every category's exact bytes and the fix command are on the page
    for cat, n in report.inventory.bytes_by_category.items():
        if n:
            assert f"{n:,}" in text, cat
    assert html._e(report.findings[0].action) in text
    # the category bar covers the file: widths in proportion to the bytes, summing to 1000
    bar = [r for r in c.rects if r.get("height") == "28"]
    assert abs(sum(float(r["width"]) for r in bar) - 1000) < len(bar)
    assert c.scripts == 1


def test_treemap_areas_are_the_bytes(demo: Path) -> None:
    report = modelsize.inspect(demo / "train.pt")
    items = html._groups(report)
    # the treemap holds every byte of the file: tensors by module + bytes no tensor holds
    assert sum(n for _, n, _, _ in items) == report.file_bytes
    rects = html.squarify([float(n) for _, n, _, _ in items], 0, 0, 1000, 520)
    total = sum(n for _, n, _, _ in items)
    for (_, n, _, _), (_x, _y, w, h) in zip(items, rects, strict=True):
        assert w * h == pytest.approx(1000 * 520 * n / total, rel=1e-6)
    assert sum(w * h for _x, _y, w, h in rects) == pytest.approx(1000 * 520)
    for x, y, w, h in rects:
        assert x >= -1e-6 and x + w <= 1000 + 1e-6 and y >= -1e-6 and y + h <= 520 + 1e-6


def test_diff_and_slim_pages(demo: Path, tmp_path: Path, capsys: Any) -> None:
    page = tmp_path / "d.html"
    assert main(["diff", str(demo / "train.pt"), str(demo / "train.slim.pt"),
                 "--html", str(page)]) == 0
    _check(page.read_text())
    slimmed = modelsize.slim(demo / "train.pt", tmp_path / "s.pt")
    text = html.render_slim(slimmed)
    _check(text)
    page = tmp_path / "s.html"
    assert main(["slim", str(demo / "train.pt"), "-o", str(tmp_path / "s2.pt"),
                 "--html", str(page)]) == 0
    _check(page.read_text())
    assert f"{slimmed.source_bytes:,}" in text and "optimizer_state" in text


def test_estimate_page_has_the_timeline_and_the_peak() -> None:
    from modelsize.cli.demo import seed_cnn

    est = modelsize.estimate(seed_cnn(), (torch.randn(8, 1, 28, 28),), mode="train")
    text = html.render_estimate(est)
    _check(text)
    assert f"peak {est.peak_bytes:,} bytes" in text
    assert "<polyline" in text
    for ph in est.phases:
        assert html._e(ph.name) in text


def test_cards_do_not_restyle_the_notebook(demo: Path) -> None:
    report = modelsize.inspect(demo / "train.pt")
    card = html.card_inspect(report)
    _check(f"<div>{card}</div>")
    css = re.findall(r"<style>(.*?)</style>", card, re.S)[0]
    selectors = re.findall(r"(?:^|})([^{}]+)\{", css)
    assert selectors and all(s.strip().startswith(".msz") for s in selectors), selectors


@pytest.mark.skipif(sys.platform != "linux", reason="the screenshot script targets Linux")
def test_pages_render_in_a_headless_browser(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import screenshot_reports as shots
    finally:
        sys.path.pop(0)
    if shots.browser() is None:
        pytest.skip("no Chromium (apt-get install chromium-headless-shell)")
    pages = shots.build_pages(tmp_path)
    for page in pages:
        png = page.with_suffix(".png")
        shots.screenshot(page, png)
        # a drawn page has the category colours, text and the treemap/timeline: many colours
        assert shots.png_colors(png) > 20, page.name


def test_notebook_reprs(demo: Path, tmp_path: Path) -> None:
    slimmed = modelsize.slim(demo / "train.pt", tmp_path / "s.pt")
    text = repr(slimmed)
    assert text.startswith("<SlimReport ") and "verified" in text and len(text) < 400
    _check(f"<div>{slimmed._repr_html_()}</div>")
    from modelsize.diff import diff

    d = diff(demo / "train.pt", demo / "train.slim.pt")
    assert repr(d).startswith("<Diff ") and "removed" in repr(d) and len(repr(d)) < 400
    _check(f"<div>{d._repr_html_()}</div>")
    report = modelsize.inspect(demo / "train.pt")
    assert repr(report).startswith("<Report ") and "optimizer_state" in repr(report)
    _check(f"<div>{report._repr_html_()}</div>")


def test_estimate_cli_html_and_repr(tmp_path: Path, capsys: Any) -> None:
    page = tmp_path / "e.html"
    assert main(["estimate", "seed-cnn", "--batch", "4", "--device", "cpu", "--no-suggest",
                 "--html", str(page)]) == 0
    capsys.readouterr()
    text = page.read_text()
    _check(text)
    assert "<polyline" in text and "Memory over the program" in text
    from modelsize.cli.demo import seed_cnn

    est = modelsize.estimate(seed_cnn(), (torch.randn(2, 1, 28, 28),), mode="infer")
    assert repr(est).startswith("<Estimate ") and f"{est.peak_bytes:,}" in repr(est)
    _check(f"<div>{est._repr_html_()}</div>")


def test_estimate_page_across_gpus_shows_each_rank_and_the_formulas() -> None:
    from torch import nn

    from modelsize.estimation.parallel import Parallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 10), nn.Linear(10, 512), nn.Linear(512, 10))
    est = modelsize.estimate(model, (torch.randn(1, 512),),
                             parallel=Parallel(8, ranks=(0, 7), units=("0", "1", "2")))
    assert est.parallel is not None
    text = html.render_estimate(est)
    _check(text)
    assert "Per rank: 8 GPUs" in text and "rank 0 (worst)" in text and "rank 7" in text
    for r in est.parallel.ranks:
        assert f"{r.peak_bytes:,} bytes" in text
    for c in est.parallel.comparisons:
        assert html._e(c.name) in text


class _Text(HTMLParser):
    """The text of every ``p``, heading and table cell of a page, outside its SVG charts."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[str] = []
        self._open: list[str] = []
        self._svg = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._svg += tag == "svg"
        if tag in ("p", "h1", "h2", "td", "th") and not self._svg:
            self._open.append("")

    def handle_endtag(self, tag: str) -> None:
        self._svg -= tag == "svg"
        if tag in ("p", "h1", "h2", "td", "th") and not self._svg and self._open:
            self.blocks.append(self._open.pop())

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1] += data


def test_estimate_page_carries_exactly_the_text_report(tmp_path: Path, capsys: Any) -> None:
    """One report: each sentence and each table cell of the terminal's report is on the page,
    the same numbers in the same units, the CUDA terms and what would shrink it included."""
    page = tmp_path / "e.html"
    assert main(["estimate", "seed-cnn", "--batch", "4", "--fit", "1GiB", "--html",
                 str(page)]) == 0
    report = capsys.readouterr().out
    text = page.read_text()
    _check(text)
    parsed = _Text()
    parsed.feed(text)
    blocks = set(parsed.blocks)
    assert "What would shrink it (each re-traced):" in report  # the text's sections
    assert "CUDA device estimate" in report and "largest batch" in report
    for line in report.splitlines():
        if not line.strip():
            continue
        if line.startswith("  "):  # a table row: its cells
            for cell in re.split(r"\s{2,}", line.strip()):
                assert cell in blocks, (cell, line)
        else:
            assert line.rstrip(":") in blocks, line


def test_estimate_page_sizes_are_human_bytes() -> None:
    """Every size on the page is :func:`modelsize.report.units.human_bytes` of a byte count
    the text report shows too (no formatting of the page's own)."""
    from modelsize.cli.demo import seed_cnn
    from modelsize.report.estimate_text import render_estimate
    from modelsize.report.units import human_bytes

    est = modelsize.estimate(seed_cnn(), (torch.randn(8, 1, 28, 28),), mode="train",
                             device="cuda")
    page, report = html.render_estimate(est), render_estimate(est)
    for n in (est.peak_bytes, *est.categories.values(), est.device_estimate.total_bytes):
        assert human_bytes(n) in report and html._e(human_bytes(n)) in page
