"""Localization on the browser runtime: a user's step ONNX judged with `--artifact-runtime
ort-web-wasm --bisect` has its marked model and every cut subgraph run in onnxruntime-web, in one
headless Chromium (harness.backends.onnxruntime_web.BrowserSession); the stage named is the one
onnxruntime CPU names, the record says where the stages ran, and the repro bundle's static page,
served on loopback and opened in Chromium, reproduces the defect.

Skips as test_ort_web.py does without chromium, Playwright or web/node_modules (fails under CI)."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from harness.backends.onnxruntime_web import BrowserRunner, BrowserSession, PageCrashed, default_drive
from harness.backends.web_page import PageServer, launch_chromium
from tests.unit.test_ort_web import _pinned, browser_runtime  # noqa: F401, F811 (its fixture)

WASM = ("wasm", "ort.wasm.min.mjs")
WASM_FILES = ["ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm", "ort.wasm.min.mjs"]


def _scale_onnx(path: Path, factor: float) -> Path:
    """y = x * factor (float32) and n = the int32 `n` + 1: a float and a cast input in one graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Mul", ["x", "k"], ["y"]), helper.make_node("Add", ["n", "one"], ["m"])]
    graph = helper.make_graph(
        nodes, "scale", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                         helper.make_tensor_value_info("n", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("m", TensorProto.INT32, [1])],
        [numpy_helper.from_array(np.array(factor, np.float32), "k"), numpy_helper.from_array(np.array([1], np.int32), "one")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


def _crash(page, cfg: dict) -> dict:
    """Chromium's own crash URL kills the page's renderer mid-run."""
    from playwright.sync_api import Error as PlaywrightError

    page.evaluate("cfg => { window.pending = window.kokoroRun(cfg); }", cfg)
    try:
        page.goto("chrome://crash", timeout=30_000)
    except PlaywrightError:
        pass
    return page.evaluate("() => window.pending")


def test_one_browser_runs_every_model_and_a_crashed_page_gives_the_next_run_a_fresh_page(tmp_path, browser_runtime):
    """A localization's runs share one Chromium (a page each); the runner casts the feed to the
    graph's types and drops what the graph does not take, as onnxruntime does; a page that crashes
    is that run's PageCrashed and the next run passes in the same session."""
    models = [_scale_onnx(tmp_path / f"x{k}.onnx", k) for k in (2.0, 3.0)]
    x = np.arange(6, dtype=np.float64).reshape(2, 3)  # float64 and int64 given: the graph says float32, int32
    with BrowserSession(*WASM) as session:
        run = BrowserRunner(session)
        times = []
        for k, model in zip((2.0, 3.0, 2.0), models + models[:1]):
            start = time.monotonic()
            got = run(model, {"x": x, "n": np.array([4]), "unused": np.zeros(1)}, ["y", "m"])
            times.append(time.monotonic() - start)
            assert got["y"].dtype == np.float32 and np.array_equal(got["y"], (x * k).astype(np.float32))
            assert got["m"].tolist() == [5]
        session.drive = _crash
        with pytest.raises(PageCrashed, match="crash"):
            run(models[0], {"x": x, "n": np.array([4])})
        session.drive = default_drive
        assert np.array_equal(run(models[1], {"x": x, "n": np.array([1])})["y"], (x * 3).astype(np.float32))
        about = run.about()
    print(f"runs in one browser: {', '.join(f'{t:.2f}' for t in times)} s")
    assert session.launches == 1  # one browser for all of them, the crash included
    assert about["ort_web"]["version"] == _pinned() and about["ort_web"]["files"] == WASM_FILES
    assert about["browser"]["version"] and about["ort_web"]["execution_provider"] == "wasm"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, browser_runtime):
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path_factory.mktemp("tiny"), compile_s=600) as s:
        yield s


@pytest.fixture(scope="module")
def bad_duration(tiny, tmp_path_factory) -> Path:
    """The tiny case's `duration` step exported with `predictor.duration_proj` x1.5, once for the
    module's tests (a dynamo export: tens of seconds)."""
    from tests.unit.test_artifact_bisect import _export

    return _export(tiny, "duration", tmp_path_factory.mktemp("bad") / "bad.onnx", "predictor.duration_proj", 1.5)


def _open_page(bundle: Path) -> tuple[dict, str]:
    """The bundle's index.html served by the harness's PageServer on loopback, opened in headless
    Chromium as a maintainer would open it: (window.reproVerdict, the page's text)."""
    from playwright.sync_api import sync_playwright

    with PageServer(trees={"/": bundle}) as server, sync_playwright() as p:
        browser = launch_chromium(p, webgpu=False)
        try:
            page = browser.new_page()
            page.goto(server.url + "/index.html")
            page.wait_for_function("window.reproVerdict !== undefined", timeout=120_000)
            return page.evaluate("window.reproVerdict"), page.inner_text("#out")
        finally:
            browser.close()


@pytest.mark.slow
def test_a_step_onnx_judged_in_the_browser_is_localized_there_and_its_bundle_page_reproduces(tiny, bad_duration):
    """`--artifact duration=bad.onnx --artifact-runtime ort-web-wasm --bisect` (duration_proj x1.5
    in the export): the browser names the stage onnxruntime CPU names, the record says the stages
    ran in onnxruntime-web wasm, and the bundle holds a page that reproduces it from its folder."""
    from harness import options, pipeline
    from harness.artifacts import ArtifactItem
    from harness.verdict import Verdict

    bad = bad_duration
    assert (bad.parent / "bad.onnx.data").is_file()  # its weights beside it: the page gets them as external data
    named = {}
    for runtime in ("native", "ort-web-wasm"):
        lines: list[str] = []
        start = time.monotonic()
        rec = pipeline.check(tiny, ArtifactItem("tiny", "duration", str(bad), "dynamic", runtime), options.Localize(),
                             log=lines.append)
        print(f"{runtime}: judged and localized in {time.monotonic() - start:.1f} s")
        print("\n".join(lines))
        assert rec.verdict is Verdict.FAIL, rec.reason
        named[runtime] = rec.bisect
    cpu, web = named["native"], named["ort-web-wasm"]
    assert cpu["first_stage"] == web["first_stage"] == "predictor.duration_proj"
    assert "runtime" not in cpu and web["judged_on"] == "ort-web-wasm"
    assert web["runtime"].startswith(f"onnxruntime-web {_pinned()} wasm (Chromium ")
    assert web["ran_on"]["ort_web"]["files"] == WASM_FILES and web["ran_on"]["browsers_started"] == 1
    assert web["note"].startswith("localized on ort-web-wasm: the marked model and every stage's subgraph ran in")
    stage = next(e for e in web["stages"] if e["stage"] == "predictor.duration_proj")
    assert stage["local"]["kind"] == "constant gain x1.5 (+3.52 dB)"

    bundle = Path(web["repro"])
    assert {"stage.onnx", "inputs.npz", "expected.npy", "repro.py", "index.html", "repro.js", "inputs.json",
            "expected.bin"} <= {p.name for p in bundle.iterdir()}
    assert sorted(p.name for p in (bundle / "ort").iterdir()) == sorted({*WASM_FILES, "ort.node.min.mjs"})
    assert json.loads((bundle / "meta.json").read_text())["ran_on"]["ort_web"]["version"] == _pinned()
    assert f"onnxruntime-web {_pinned()}" in (bundle / "REPORT.md").read_text()
    verdict, text = _open_page(bundle)
    print(text)
    assert verdict["reproduced"] is True and verdict["rel_l2"] == pytest.approx(0.5, rel=1e-3), text
    assert "predictor.duration_proj: rel_l2 5.000e-1" in text and text.rstrip().endswith("reproduced")
    # the same stage in Node.js on onnxruntime-web's WebAssembly build, from the bundle alone
    node = subprocess.run(["node", "repro.mjs"], cwd=bundle, capture_output=True, text=True, timeout=300)
    print(node.stdout, node.stderr)
    assert node.returncode == 1, node.stdout + node.stderr
    assert "in Node.js v" in node.stdout and "predictor.duration_proj: rel_l2 5.000e-1" in node.stdout, node.stdout


@pytest.mark.slow
def test_bisect_on_a_device_item_runs_every_stage_and_probe_on_the_devices_page(tiny, bad_duration, tmp_path, capsys):
    """`--target phone --bisect`: a user's step ONNX judged on the device's page is localized on
    that page (its marked model, each stage's subgraph), not in a Chromium of this machine, and the
    record names the device's browser; a backend step's probes run there too. The "phone" is a
    second headless Chromium with its own user agent that opens the printed URL once."""
    from harness import options, pipeline
    from harness.artifacts import ArtifactItem
    from harness.runner import Item
    from harness.verdict import Verdict
    from tests.unit.test_ort_web import PHONE_UA, _device_target, phone_opens

    bad = bad_duration
    _device_target(tiny, tmp_path, "phone", wait_s=60)
    mine = ArtifactItem("tiny", "duration", str(bad), "dynamic", "ort-web-wasm", target="phone")
    step = Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic", target="phone")
    records, lines = [], []
    with phone_opens(tiny, capsys, "phone", lambda: records.extend(
            [pipeline.check(tiny, mine, options.Localize(), log=lines.append),
             pipeline.check(tiny, step, options.Localize(depth=1, verify=False, force=True), log=lines.append)]),
            lines, join_s=900) as page:
        ran = int(page.inner_text("body").split(" run(s) done")[0].split()[-1])
    print("\n".join(lines))
    (rec, probed) = records
    assert rec.verdict is Verdict.FAIL and rec.bisect["first_stage"] == "predictor.duration_proj", rec.reason
    web = rec.bisect
    assert web["runtime"] == f"onnxruntime-web {_pinned()} wasm (the device's browser, {PHONE_UA})"
    assert web["ran_on"]["browser"] == {"user_agent": PHONE_UA, "device": True}
    assert web["ran_on"]["browsers_started"] == 0 and "ort.wasm.min.mjs" in web["ran_on"]["ort_web"]["files"]
    stage = next(e for e in web["stages"] if e["stage"] == "predictor.duration_proj")
    assert stage["local"]["kind"] == "constant gain x1.5 (+3.52 dB)"
    assert probed.verdict is Verdict.PASS and probed.bisect["ran_on"]["device"]["user_agent"] == PHONE_UA, probed.bisect
    assert any("the probes ran on target 'phone'" in ln for ln in lines), lines
    assert ran > 4, ran  # the items' runs, the marked model, the stages, the probes: all on the page
