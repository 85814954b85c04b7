"""The dashboard, built from the recorded history in data/nightly/ and opened in headless Chromium.

The browser is Debian's chromium (installed by .ci/run), driven by Playwright with its own
browser downloads never used. Without chromium the browser tests skip, except under CI, where
they fail: a green CI must have looked at the pages.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from harness.dashboard import NOT_RUN_COLOR, VERDICT_COLORS, build_dashboard
from harness.history import load_history

FIXTURE = Path(__file__).parent / "data" / "nightly"
REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _copy_reports(dst: Path) -> Path:
    shutil.copytree(FIXTURE / "history", dst / "history")
    shutil.copytree(FIXTURE / "audio", dst / "audio")
    return dst


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    reports = _copy_reports(tmp_path_factory.mktemp("reports"))
    return build_dashboard(reports / "history", reports / "dashboard", report_dir=reports)


@pytest.fixture(scope="module")
def latest():
    return load_history(FIXTURE / "history").latest


def _cells(latest) -> int:
    dims = [{r[k] for r in latest.records} for k in ("case", "step", "backend", "mode")]
    return len(dims[0]) * len(dims[1]) * len(dims[2]) * len(dims[3])


# ----------------------------------------------------------------------------- without a browser

def test_the_site_has_every_page_and_needs_no_network(site: Path, latest):
    for page in ("index.html", "trends.html", "runs.html", "assets/plotly.min.js", "assets/style.css"):
        assert (site / page).is_file(), page
    for rec in latest.records:
        assert (site / "items" / f"{rec['case']}-{rec['step']}-{rec['backend']}-{rec['mode']}.html").is_file()
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert not re.search(r'(src|href)="(https?:)?//', text), f"{html} refers to the network"
        assert "<script" not in text or "plotly.min.js" in text


def test_every_run_is_listed_with_its_versions(site: Path):
    text = (site / "runs.html").read_text()
    for run in load_history(FIXTURE / "history").runs:
        assert run.id in text and run.git["commit"][:10] in text
        assert run.versions["torch"] in text and run.versions["backends"]["xnnpack"] in text


def test_errors_skips_bisection_and_repro_bundles_render(tmp_path: Path):
    """Records of kinds the fixture has no real instance of: the same real records, edited."""
    reports = _copy_reports(tmp_path)
    path = sorted((reports / "history").glob("*.json"))[-1]
    run = json.loads(path.read_text())
    recs = run["records"]
    recs[0].update(verdict="crashed", reason="child died with signal SIGSEGV", metrics={}, log="Segmentation fault")
    recs[1].update(verdict="skipped", reason="package(s) not installed: coremltools", metrics={})
    recs[2].update(verdict="compile_error", reason="XNNPACK: unsupported op aten.foo", metrics={})
    (reports / "repro" / "bundle").mkdir(parents=True)
    recs[3]["bisect"] = {  # the shape harness.bisect writes
        "status": "localized", "message": "first diverging op convolution_7 (aten.convolution.default, local)",
        "first_module": "decoder.generator.ups.1",
        "first_op": {"node": "convolution_7", "op": "aten.convolution.default", "module": "decoder.generator.ups.1",
                     "source": "torch/nn/modules/conv.py:1160", "kind": "local", "why": "rel_l2 0.3",
                     "after": {"rel_l2": 0.3, "floor_ratio": 5e4}},
        "modules": [{"module": "decoder.generator.ups.1", "type": "ConvTranspose1d", "status": "fail", "n_ops": 1,
                     "rel_l2": 0.3, "floor_ratio": 5e4}],
        "repro": {"path": str(reports / "repro" / "bundle"), "bytes": 2048, "n_ops": 1, "reproduces": True}}
    recs[4]["repro_dir"] = "repro/bundle"  # a plain field, relative to the report dir
    path.write_text(json.dumps(run))
    (reports / "history" / "20000101T000000Z-garbage.json").write_text("{not json")
    site = build_dashboard(reports / "history", reports / "dashboard", report_dir=reports)
    index = (site / "index.html").read_text()
    for rec, text in ((recs[0], "SIGSEGV"), (recs[1], "coremltools"), (recs[2], "unsupported op")):
        iid = f"{rec['case']}-{rec['step']}-{rec['backend']}-{rec['mode']}"
        cell = re.search(rf'<td class="cell v-(\w+)" data-item="{iid}".*?</td>', index, re.S)
        assert cell and cell.group(1) == rec["verdict"] and text in cell.group(0)
    assert "20000101T000000Z-garbage.json" in index and "could not be read" in index
    for rec in recs[3:5]:
        iid = f"{rec['case']}-{rec['step']}-{rec['backend']}-{rec['mode']}"
        item = (site / "items" / f"{iid}.html").read_text()
        href = re.search(r'id="repro-link" href="([^"]+)"', item).group(1)
        assert (site / "items" / href).resolve() == (reports / "repro" / "bundle").resolve()
    iid = f"{recs[3]['case']}-{recs[3]['step']}-{recs[3]['backend']}-{recs[3]['mode']}"
    item = (site / "items" / f"{iid}.html").read_text()
    assert "convolution_7" in item and "ConvTranspose1d" in item and "reproduces when run alone" in item


def test_an_artifacts_noise_band_is_drawn(tmp_path: Path, page):
    """A whole-model artifact's record (harness/port/chain.py writes `bands`): its item page draws
    each metric's band, the margin around it and the artifact's value, in the verdict's colour."""
    reports = _copy_reports(tmp_path)
    path = sorted((reports / "history").glob("*.json"))[-1]
    run = json.loads(path.read_text())
    rec = run["records"][0]
    rec["bands"] = {
        "pesq": {"value": 3.83, "band": [4.57, 4.60], "ok": False, "direction": "higher", "k": 16,
                 "why": "pesq 3.83 outside noise band [4.57, 4.6] +/- 0.015"},
        "rms_ratio_db": {"value": 0.001, "band": [-0.004, 0.005], "ok": True, "direction": "both", "k": 16,
                         "why": "rms_ratio_db 0.001 in noise band"},
        "zero_noise": {"rel_l2": 0.4, "snr_db": 8.0, "kind": "noise-like", "why": "sample by sample"}}
    path.write_text(json.dumps(run))
    site = build_dashboard(reports / "history", reports / "dashboard", report_dir=reports)
    item = site / "items" / f"{rec['case']}-{rec['step']}-{rec['backend']}-{rec['mode']}.html"
    text = item.read_text()
    assert "Audio against the noise band" in text and 'id="band"' in text
    page.goto(item.as_uri())
    page.wait_for_selector("#band .plot-container")
    traces = page.evaluate("() => document.getElementById('band').data.map(t => [t.type, t.y[0], t.x[0]])")
    assert ["scatter", "pesq", 3.83] in traces and ["scatter", "rms_ratio_db", 0.001] in traces
    assert {tuple(t[:2]) for t in traces if t[0] == "bar"} == {("bar", "pesq"), ("bar", "rms_ratio_db")}
    colors = page.evaluate("() => document.getElementById('band').data.filter(t => t.type == 'scatter')"
                           ".map(t => t.marker.color)")
    assert colors == ["#b42318", "#1a7f37"]  # outside its band: the fail colour; inside: pass
    assert not page.errors, page.errors


# ----------------------------------------------------------------------------- in Chromium

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    problem = None
    if not os.path.exists(CHROMIUM):
        problem = f"{CHROMIUM} not installed (apt-get install chromium)"
    else:
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            problem = "playwright not installed (pip install -e '.[dashboard]')"
    if problem:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 900})
        yield ctx
        ctx.close()


@pytest.fixture
def page(browser):
    """A page that collects console errors, uncaught exceptions and failed loads."""
    pg = browser.new_page()
    pg.errors = []
    pg.on("console", lambda m: m.type == "error" and pg.errors.append(f"console: {m.text}"))
    pg.on("pageerror", lambda e: pg.errors.append(f"pageerror: {e}"))
    pg.on("requestfailed", lambda r: pg.errors.append(f"requestfailed: {r.url} {r.failure}"))
    yield pg
    pg.close()


def _rgb(hex_color: str) -> str:
    h = hex_color.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i:i + 2], 16) for i in (0, 2, 4)))


def test_matrix_has_a_cell_per_item_coloured_by_verdict(site: Path, latest, page):
    page.goto((site / "index.html").as_uri())
    cells = page.locator("#matrix td.cell")
    assert cells.count() == _cells(latest) == len(latest.records)
    seen = set()
    for i in range(cells.count()):
        cell = cells.nth(i)
        verdict = cell.get_attribute("data-verdict")
        rec = latest.by_item()[cell.get_attribute("data-item")]
        assert verdict == rec["verdict"]
        color = cell.evaluate("e => getComputedStyle(e).backgroundColor")
        assert color == _rgb(VERDICT_COLORS.get(verdict, NOT_RUN_COLOR)), (verdict, color)
        assert verdict.replace("_", " ") in cell.inner_text().lower()
        seen.add(verdict)
    assert {"pass", "fail"} <= seen
    assert page.locator("#regressions li").count() > 0  # the strict run regressed
    assert page.locator("#overview .main-svg").count() > 0
    page.screenshot(path=str(_artifact("dashboard-screenshot.png")), full_page=True)
    assert page.errors == []


def test_trend_plots_render_with_regressions_marked(site: Path, page):
    page.goto((site / "trends.html").as_uri())
    runs = load_history(FIXTURE / "history").runs
    pairs = {(r["step"], r["backend"]) for run in runs for r in run.records}
    plots = page.locator(".js-plotly-plot")
    assert plots.count() == len(pairs)
    for i in range(plots.count()):
        # one line per (case, mode) and the regression trace, each drawn as SVG
        assert plots.nth(i).locator("g.trace.scatter").count() >= 2
        assert plots.nth(i).locator("g.trace.scatter path.point").count() >= len(runs)
    decoder = page.locator("#trend-decoder-eager-card")
    assert "regression" in decoder.inner_text()
    rings = decoder.locator("g.trace.scatter").last.locator("path.point")
    assert rings.count() > 0  # the regressed points of the strict run
    # the menu switches the metric: the y values become the records' relative L2 errors
    plot = decoder.locator(".js-plotly-plot")
    decoder.locator(".updatemenu-header-group").click()
    decoder.locator(".updatemenu-item-text", has_text="relative L2").click()
    page.wait_for_function("e => e.layout.yaxis.title.text.startsWith('relative L2')", arg=plot.element_handle())
    name = plot.evaluate("e => e.data[0].name")  # "<case> · <mode>"
    case, mode = name.split(" · ")
    want = [max(m["rel_l2"] for m in run.by_item()[f"{case}-decoder-eager-{mode}"]["metrics"].values()) for run in runs]
    assert plot.evaluate("e => e.data[0].y") == pytest.approx(want)
    page.screenshot(path=str(_artifact("dashboard-trends-screenshot.png")), full_page=True)
    assert page.errors == []


def test_an_item_page_opens_from_the_matrix_with_playable_audio(site: Path, latest, page):
    page.goto((site / "index.html").as_uri())
    rec = next(r for r in latest.records if r["step"] == "decoder" and r["backend"] == "xnnpack")
    iid = f"{rec['case']}-{rec['step']}-{rec['backend']}-{rec['mode']}"
    page.locator(f'#matrix td.cell[data-item="{iid}"] a').click()
    page.wait_for_load_state("load")
    assert page.url.endswith(f"items/{iid}.html")
    assert page.locator("#verdict").inner_text().lower() == rec["verdict"]
    audios = page.locator("#audio audio")
    assert audios.count() == 2
    for i in range(2):
        src = audios.nth(i).evaluate("a => a.src")
        assert Path(unquote(urlparse(src).path)).is_file(), src
        # the browser itself could read it: metadata loaded, the duration is the record's
        audios.nth(i).evaluate("a => new Promise(r => a.readyState >= 1 ? r() : a.addEventListener('loadedmetadata', r))")
        assert audios.nth(i).evaluate("a => a.duration") > 0.1
    assert page.locator("#spectrogram").evaluate("i => i.complete && i.naturalWidth") > 0
    assert page.locator("#metrics").count() == 1 and page.locator("#timings").count() == 1
    assert page.locator(".js-plotly-plot .main-svg").count() >= 2  # error budget and the item's trend
    page.screenshot(path=str(_artifact("dashboard-item-screenshot.png")), full_page=True)
    assert page.errors == []


def test_every_page_loads_without_console_errors(site: Path, page):
    for html in sorted(site.rglob("*.html")):
        page.goto(html.as_uri())
        page.wait_for_load_state("load")
        assert page.errors == [], html


def _artifact(name: str) -> Path:
    out = REPO / "reports"
    out.mkdir(exist_ok=True)
    return out / name
