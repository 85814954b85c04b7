"""The ort-web-wasm and ort-web-webgpu backends: onnxruntime's ONNX file of a random-weight step run
by onnxruntime-web in Debian's headless Chromium (pages served on 127.0.0.1), judged against the
reference; the record says where it ran; a crashed or silent page is its item's verdict.

Without chromium, Playwright or web/node_modules these tests skip, except under CI, where they fail
(`make install` runs `npm ci --prefix web`; .ci/run installs chromium)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.backends import EXTRA_ENV, get_backend
from harness.backends.onnxruntime_web import OrtWebWasmBackend, ort_web_version, web_dir
from harness.backends.web_page import CHROMIUM, PageServer
from harness.plumbing.jobs import run_job

REPO = Path(__file__).resolve().parents[2]
FAULTS = ("ort-web-crash=tests.unit.test_ort_web:CrashingPage,"
          "ort-web-hang=tests.unit.test_ort_web:SilentPage")
PIDS_ENV = "KOKORO_PARITY_TEST_BROWSER_PIDS"  # where the fault backends write their browser's processes


def _problem() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not installed (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright not installed (pip install -e '.[web]')"
    if ort_web_version() is None:
        return f"onnxruntime-web not installed in {web_dir()} (npm ci --prefix web)"
    return None


@pytest.fixture(scope="module")
def browser_runtime():
    problem = _problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)


def _write_pids(page) -> None:
    """The browser's processes ({pid: type}, Chromium's own account), for the test to see which
    browser the page ran in and what is gone after it."""
    info = page.context.browser.new_browser_cdp_session().send("SystemInfo.getProcessInfo")
    Path(os.environ[PIDS_ENV]).write_text(json.dumps({p["id"]: p["type"] for p in info["processInfo"]}))


def _browser_pid(pids: dict) -> int:
    (pid,) = [int(p) for p, kind in pids.items() if kind == "browser"]
    return pid


class CrashingPage(OrtWebWasmBackend):
    """Kills the page's renderer while its session is being created and run."""

    name = "ort-web-crash"

    def drive(self, page, cfg: dict) -> dict:
        _write_pids(page)
        from playwright.sync_api import Error as PlaywrightError

        page.evaluate("cfg => { window.pending = window.kokoroRun(cfg); }", cfg)
        try:  # Chromium's own crash URL kills the renderer (CDP's Page.crash never answers)
            page.goto("chrome://crash", timeout=30_000)
        except PlaywrightError:
            pass  # the navigation is aborted by the crash
        return page.evaluate("() => window.pending")


class SilentPage(OrtWebWasmBackend):
    """A page that never answers: the run job's time limit must end it, browser included."""

    name = "ort-web-hang"

    def drive(self, page, cfg: dict) -> dict:
        _write_pids(page)
        return page.evaluate("() => new Promise(() => {})")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, browser_runtime):
    from tests.unit.conftest import tiny_session_at

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EXTRA_ENV, FAULTS)
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        mp.setenv(PIDS_ENV, str(tmp_path_factory.mktemp("pids") / "browser.json"))
        with tiny_session_at(tmp_path_factory.mktemp("tiny"), compile_s=600) as s:
            yield s


def _pinned() -> str:
    return json.loads((REPO / "web" / "package.json").read_text())["dependencies"]["onnxruntime-web"]


@pytest.mark.slow
def test_both_browser_backends_pass_a_random_step_and_record_where_it_ran(tiny):
    """The same ONNX file as onnxruntime's (one compile), run in the browser and judged like any item."""
    from harness.runner import Item
    from harness.verdict import Verdict

    wasm = tiny.run(Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic"))
    assert wasm.verdict is Verdict.PASS, wasm.reason
    assert wasm.audit["ort_web"]["version"] == _pinned() and wasm.audit["ort_web"]["execution_provider"] == "wasm"
    assert "HeadlessChrome" in wasm.audit["browser"]["user_agent"]
    assert wasm.audit["browser"]["shared"] is True and wasm.audit["browser"]["launched_by"] == "session"
    assert f"onnxruntime-web=={_pinned()}" in wasm.versions["backend"]
    assert set(wasm.audit["placement"]) == {"CPUExecutionProvider"}  # the wasm provider is the CPU one
    assert "ops_on_cpu" not in wasm.audit  # so nothing "falls back" there
    assert wasm.audit["placement"]["CPUExecutionProvider"]["nodes"] > 0

    ok, why = get_backend("ort-web-webgpu").runnable()
    gpu = tiny.run(Item("tiny", "bert_encoder", "ort-web-webgpu", "dynamic"))
    if not ok:
        assert gpu.verdict is Verdict.SKIPPED and "no WebGPU" in gpu.reason, gpu.reason
        pytest.skip(why)
    assert gpu.verdict is Verdict.PASS, gpu.reason
    assert gpu.cache["artifact"] == "hit"  # the wasm item's ONNX file
    adapter = gpu.audit["webgpu_adapter"]
    assert adapter["vendor"] and isinstance(adapter["shader_f16"], bool) and adapter["limits"]["maxBufferSize"] > 0
    placed = gpu.audit["placement"]
    assert placed["WebGpuExecutionProvider"]["nodes"] > 0
    for op, n in gpu.audit["ops_on_cpu"].items():  # every fallback is a node the CPU provider took
        assert placed["CPUExecutionProvider"]["ops"][op] == n
    assert len(gpu.audit["nodes_on_cpu"]) == min(sum(gpu.audit["ops_on_cpu"].values()), 41)



def test_the_float16_cast_keeps_float32_io_and_onnxruntime_runs_it_close_to_float32(tmp_path):
    """The web ports' cast (onnxconverter-common, keep_io_types=True) of a MatMul, Add, Relu graph:
    float16 weights, float32 inputs and outputs, and onnxruntime CPU's result of it within float16's
    rounding of the float32 file's."""
    pytest.importorskip("onnxconverter_common")
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from harness.backends.onnxruntime_web import cast_to_float16

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["s"]),
         helper.make_node("Relu", ["s"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    # ir_version 10: onnxruntime 1.31 reads 13 at most, onnx 1.23 writes 14
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, tmp_path / "fp32.onnx")

    audit = cast_to_float16(tmp_path / "fp32.onnx", tmp_path / "fp16.onnx")
    half = onnx.load(str(tmp_path / "fp16.onnx"))
    assert {t.data_type for t in half.graph.initializer} == {TensorProto.FLOAT16}
    assert audit["program_dtype"] == "float16" and audit["initializer_dtypes"] == {"float16": 2}
    assert "keep_io_types=True" in audit["cast"]
    for v in (*half.graph.input, *half.graph.output):
        assert v.type.tensor_type.elem_type == TensorProto.FLOAT, v.name

    x = rng.standard_normal((4, 16)).astype(np.float32)
    run = lambda f: ort.InferenceSession(str(tmp_path / f), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    full, cast = run("fp32.onnx"), run("fp16.onnx")
    assert cast.dtype == np.float32 and not np.array_equal(cast, full)  # it did compute in float16
    assert np.linalg.norm(cast - full) / np.linalg.norm(full) < 5e-3


@pytest.mark.slow
def test_ort_web_webgpu_fp16_is_skipped_naming_shader_f16_where_the_adapter_lacks_it(tiny):
    """The web ports' float16 file on WebGPU: SKIPPED, naming shader-f16, on an adapter without it
    (SwiftShader), never a PASS; on one with it, run and judged by the float16 floor."""
    from harness.backends import precision_of
    from harness.backends.onnxruntime_web import webgpu_adapter
    from harness.runner import Item
    from harness.verdict import Verdict

    ok, why = get_backend("ort-web-webgpu-fp16").available()
    if not ok:
        pytest.skip(why)
    assert precision_of(get_backend("ort-web-webgpu-fp16")) == "float16"
    rec = tiny.run(Item("tiny", "bert_encoder", "ort-web-webgpu-fp16", "dynamic"))
    adapter = webgpu_adapter()  # what the harness's own check sees (SwiftShader here)
    if "error" in adapter:
        assert rec.verdict is Verdict.SKIPPED and "no WebGPU" in rec.reason, rec.reason
        pytest.skip(adapter["error"])
    if not adapter["shader_f16"]:
        assert rec.verdict is Verdict.SKIPPED, rec.reason
        assert rec.reason.endswith("has no shader-f16: float16 web models need it"), rec.reason
        assert f"({adapter['vendor']} {adapter['architecture']}" in rec.reason, rec.reason
        assert rec.audit["program_dtype"] == "float16" and rec.audit["initializer_dtypes"].get("float16")
        return
    assert rec.verdict in (Verdict.PASS, Verdict.FAIL) and rec.precision == "float16", rec.reason  # the float16 floor
    assert rec.audit["webgpu_adapter"]["shader_f16"] is True and rec.audit["ort_web"]["execution_provider"] == "webgpu"


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in _state(p)]:
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid)


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a shared browser's: it leads its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _pages(shared) -> list[str]:
    """The page targets open in a shared browser besides its startup page."""
    return [t["url"] for t in json.loads(shared._get("/json/list", timeout=5))
            if t["type"] == "page" and t["id"] != shared._first_page]


def _timed_run(session, item):
    start = time.monotonic()
    rec = session.run(item)
    print(f"{rec.item_id}: {rec.verdict.value} in {time.monotonic() - start:.1f} s (run job "
          f"{rec.timings.get('run_job_s', 0):.1f} s), browser {rec.audit.get('browser', {}).get('pid')}", file=sys.stderr)
    return rec


@pytest.mark.slow
def test_two_items_of_one_run_share_its_browser_and_a_dead_browser_is_started_again(tiny):
    """Two items in one session: one Chromium (the same process, no launch between them), each
    item's record saying so; the browser killed between items (as the OOM killer would): the next
    item passes in a new one, the record counting it."""
    from harness.runner import Item
    from harness.verdict import Verdict

    item = Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic")
    first, second = _timed_run(tiny, item), _timed_run(tiny, item)
    shared = tiny._browsers["wasm"]
    for rec in (first, second):
        assert rec.verdict is Verdict.PASS, rec.reason
        about = rec.audit["browser"]
        assert about["shared"] is True and about["launched_by"] == "session" and "HeadlessChrome" in about["user_agent"]
    assert first.audit["browser"]["pid"] == second.audit["browser"]["pid"] == shared.pid and _alive(shared.pid)
    assert first.audit["browser"]["browsers_started"] == second.audit["browser"]["browsers_started"] == shared.launches
    assert not _pages(shared), "a run's page outlived its run"
    launches, old = shared.launches, shared.pid
    os.killpg(old, 9)
    assert _gone([old])
    third = _timed_run(tiny, item)
    assert third.verdict is Verdict.PASS, third.reason
    assert third.audit["browser"]["pid"] == shared.pid != old and third.audit["browser"]["browsers_started"] == launches + 1


@pytest.mark.slow
def test_a_crashed_page_and_a_silent_page_are_their_items_verdicts_and_the_next_item_passes(tiny):
    """In the session's shared browser: the crashed page is its item's CRASHED and the browser
    lives on; the silent page is its item's TIMEOUT, its child killed and its page closed, the
    browser left running; the next item passes in that same browser."""
    from harness.runner import Item, Limits
    from harness.verdict import Verdict

    pids = Path(os.environ[PIDS_ENV])
    limits, tiny.limits = tiny.limits, Limits(run_s=120)
    try:
        crashed = _timed_run(tiny, Item("tiny", "bert_encoder", "ort-web-crash", "dynamic"))
    finally:
        tiny.limits = limits
    assert crashed.verdict is Verdict.CRASHED and "crash" in crashed.reason.lower(), crashed.reason
    shared = tiny._browsers["wasm"]
    browser = _browser_pid(json.loads(pids.read_text()))
    assert browser == shared.pid == crashed.audit["browser"]["pid"]  # the page ran in the session's browser
    assert crashed.audit["browser"]["shared"] is True and _alive(browser)  # a renderer's crash, not the browser's
    assert not _pages(shared)
    limits, tiny.limits = tiny.limits, Limits(run_s=20)
    try:
        hung = _timed_run(tiny, Item("tiny", "bert_encoder", "ort-web-hang", "dynamic"))
    finally:
        tiny.limits = limits
    assert hung.verdict is Verdict.TIMEOUT and "no result after 20 s" in hung.reason, hung.reason
    assert _browser_pid(json.loads(pids.read_text())) == browser and _alive(browser)
    assert not _pages(shared), "the killed run's page is still open"
    after = _timed_run(tiny, Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic"))
    assert after.verdict is Verdict.PASS, after.reason
    assert after.audit["browser"]["pid"] == browser and after.audit["browser"]["shared"] is True


@pytest.mark.slow
def test_the_shared_browsers_are_gone_after_the_session_closes(tiny):
    """Session.close ends each provider's browser and every process it started; the next item of
    a session used again starts a new one."""
    from harness.runner import Item
    from harness.verdict import Verdict

    rec = _timed_run(tiny, Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic"))
    assert rec.verdict is Verdict.PASS, rec.reason
    groups = {b.pid: _group(b.pid) for b in tiny._browsers.values() if b.pid}
    assert groups and all(len(g) > 2 for g in groups.values())  # the browser, its zygotes, its renderers...
    tiny.close()
    for pgid, members in groups.items():
        assert _gone(members) and not _group(pgid), f"Chromium {pgid}'s processes outlived the session"
    assert all(b.pid is None for b in tiny._browsers.values())


def test_the_page_server_serves_its_files_and_nothing_outside_them(tmp_path):
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "a.js").write_text("x")
    (tmp_path / "secret").write_text("no")
    with PageServer(trees={"/ort/": tmp_path / "tree"}, blobs={"/input/0": b"\x01\x02"}) as s:
        assert s.url.startswith("http://127.0.0.1:")
        assert s.resolve("/ort/a.js") == (tmp_path / "tree" / "a.js").resolve()
        assert s.resolve("/ort/../secret") is None and s.resolve("/ort/%2e%2e/secret") is None
        assert s.resolve("/input/0") == b"\x01\x02" and s.resolve("/nothing") is None


@pytest.mark.slow
def test_a_90_mb_model_loads_from_the_server_in_both_providers(tmp_path, browser_runtime):
    """The size of Kokoro's float32 ONNX: served from its file, fetched by the page, never inlined."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((2400, 2400), dtype=np.float32) / 50 for _ in range(4)]  # 4 x 23 MB
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"], [f"h{i + 1}"]) for i in range(4)]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2400])],
                              [helper.make_tensor_value_info("h4", TensorProto.FLOAT, [1, 2400])],
                              [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)])
    art = tmp_path / "art"
    art.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
              str(art / "model.onnx"))
    assert (art / "model.onnx").stat().st_size > 90e6
    (art / "io.json").write_text(json.dumps({"inputs": ["x"]}))
    x = torch.from_numpy(rng.standard_normal((1, 2400), dtype=np.float32))
    torch.save([x], tmp_path / "inputs.pt")
    expected = x.double().numpy()
    for w in weights:
        expected = expected @ w.astype(np.float64)
    for name in ("ort-web-wasm", "ort-web-webgpu"):
        ok, why = get_backend(name).runnable()
        if not ok:
            continue
        r = run_job("harness.backends:run_artifact_job", dict(
            backend=name, artifact_path=str(art / "model.onnx"), inputs_path=str(tmp_path / "inputs.pt"),
            outputs_path=str(tmp_path / f"{name}.pt")), tmp_path / name, 300)
        assert r.ok, f"{name}: {r.error}\n{r.log_tail}"
        out = torch.load(tmp_path / f"{name}.pt", weights_only=True)[0].double().numpy()
        assert np.linalg.norm(out - expected) / np.linalg.norm(expected) < 1e-5, name


def test_without_onnxruntime_web_or_chromium_the_backends_say_why(tmp_path, monkeypatch):
    from harness.backends import onnxruntime_web

    monkeypatch.setenv("KOKORO_PARITY_WEB_DIR", str(tmp_path))  # a web/ where npm ci never ran
    for name in ("ort-web-wasm", "ort-web-webgpu"):
        ok, why = get_backend(name).available()
        if "package(s) not installed" in why:
            continue  # (the extra itself missing says so first)
        assert not ok and why == f"onnxruntime-web not installed in {tmp_path}/node_modules (npm ci --prefix web)"
    monkeypatch.setattr(onnxruntime_web, "CHROMIUM", str(tmp_path / "no-chromium"))
    ok, why = get_backend("ort-web-wasm").available()
    assert not ok and ("not installed (apt-get install chromium)" in why or "package(s) not installed" in why)


# ---- a user's own ONNX file on onnxruntime-web (`--artifact-runtime`, a port stage's `runtime:`) ----

def _user_step_onnx(session, path: Path, fault: bool = False) -> Path:
    """The tiny random model's `bert_encoder` step (a Linear, then a transpose) written as a user
    writes an ONNX by hand, from the model's own weights: no export. With `fault`, the output is
    multiplied by 1.5 before it leaves the graph (a defect the judge must see)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    linear = session.model.kmodel.bert_encoder
    w = linear.weight.detach().float().numpy().T.copy()  # [768, 512]
    b = linear.bias.detach().float().numpy()
    out = "scaled" if fault else "d_en"
    nodes = [helper.make_node("MatMul", ["bert_dur", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Transpose", ["hb"], [out if not fault else "t"], perm=[0, 2, 1])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    if fault:
        nodes.append(helper.make_node("Mul", ["t", "k"], ["d_en"]))
        inits.append(numpy_helper.from_array(np.array(1.5, dtype=np.float32), "k"))
    graph = helper.make_graph(nodes, "user_bert_encoder",
                              [helper.make_tensor_value_info("bert_dur", TensorProto.FLOAT, [1, "tokens", w.shape[0]])],
                              [helper.make_tensor_value_info("d_en", TensorProto.FLOAT, [1, w.shape[1], "tokens"])],
                              inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


@pytest.fixture(scope="module")
def user_onnx(tiny, tmp_path_factory):
    """(clean, faulty) user ONNX files of the tiny model's bert_encoder, its case's references made
    (the module's session cost, shared: minutes on a busy 2-core machine, not the tests' own)."""
    tiny.traces("tiny")
    out = tmp_path_factory.mktemp("user_onnx")
    return _user_step_onnx(tiny, out / "mine.onnx"), _user_step_onnx(tiny, out / "mine_bad.onnx", fault=True)


def _show(rec) -> str:
    m = rec.metrics["d_en"]
    return (f"{rec.item_id}: {rec.verdict.value}, rel L2 {m['rel_l2']:.3g} vs the fp32 floor {m['floor_rel_l2']:.3g} "
            f"(x{m['floor_ratio']:.3g})")


def test_a_users_step_onnx_runs_in_the_browser_with_artifact_runtime_and_a_fault_fails(tiny, user_onnx, monkeypatch):
    """`--artifact bert_encoder=mine.onnx --artifact-runtime native --artifact-runtime ort-web-wasm`:
    one item per runtime (distinct ids), the browser's run judged like the native one, its record
    naming the runtime, onnxruntime-web, the browser and the nodes each provider ran; the same file
    with a Mul by 1.5 before its output FAILs in the browser."""
    import argparse

    from harness import options, pipeline
    from harness.verdict import Verdict

    clean, bad = user_onnx
    parser = argparse.ArgumentParser()
    options.add_argparse(parser, options.RUN)
    args = parser.parse_args([f"--artifact=bert_encoder={clean}", "--artifact-runtime=native",
                              "--artifact-runtime=ort-web-wasm", "--mode=dynamic"])
    config = options.RunConfig.from_options(lambda name: getattr(args, name))
    assert config.artifact_runtimes == ("native", "ort-web-wasm")
    items = pipeline.items(tiny, config, [])
    assert [i.id for i in items] == ["tiny-bert_encoder-artifact-mine_onnx-dynamic",
                                     "tiny-bert_encoder-artifact-mine_onnx@ort-web-wasm-dynamic"]
    native, web = (pipeline.check(tiny, i) for i in items)
    print(_show(native))
    print(_show(web))
    assert native.verdict is Verdict.PASS and web.verdict is Verdict.PASS, web.reason
    assert web.backend == "artifact-mine_onnx@ort-web-wasm" and web.audit["runtime"] == "ort-web-wasm"
    assert web.audit["ort_web"]["version"] == _pinned() and web.audit["ort_web"]["execution_provider"] == "wasm"
    assert "HeadlessChrome" in web.audit["browser"]["user_agent"] and web.audit["browser"]["version"]
    assert web.audit["placement"]["CPUExecutionProvider"]["nodes"] > 0
    assert f"runtime=ort-web-wasm,onnxruntime-web=={_pinned()},chromium==" in web.versions["backend"]
    assert "runtime" not in native.audit and "browser" not in native.audit  # onnxruntime CPU, in Python
    assert web.metrics["d_en"]["rel_l2"] < 1e-5

    from harness.artifacts import ArtifactItem

    # --bisect: the browser's run is the verdict, and the stages run in the same browser runtime.
    # bert_encoder (one Linear) has no module inside to cut, so the localizer's run is stood in for here:
    # what is checked is that the browser item reaches it with the user's file and its runtime (the
    # localization in the browser itself: test_ort_web_localize.py)
    from harness.port import onnx_steps

    cut = []

    def stand_in(session, artifact, case_id, step, mapping, rec, *args, runtime="native", **kwargs):
        cut.append((artifact, runtime))
        rec.bisect = {"kind": "onnx-stages", "artifact": str(artifact), "step": step, "stages": []}
        return rec.bisect

    monkeypatch.setattr(onnx_steps, "localize_step", stand_in)
    lines: list[str] = []
    failed = pipeline.check(tiny, ArtifactItem("tiny", "bert_encoder", str(bad), "dynamic", "ort-web-wasm"),
                            options.Localize(), log=lines.append)
    print(_show(failed))
    assert failed.verdict is Verdict.FAIL and failed.audit["runtime"] == "ort-web-wasm", failed.reason
    assert 0.49 < failed.metrics["d_en"]["rel_l2"] < 0.51  # 1.5x: half of the reference's norm
    assert cut == [(bad, "ort-web-wasm")]


def test_a_users_step_onnx_on_ort_web_webgpu_passes_with_its_adapter_or_is_skipped_saying_why(tiny, user_onnx):
    from harness.artifacts import ArtifactItem, check_artifact
    from harness.backends.onnxruntime_web import webgpu_missing
    from harness.verdict import Verdict

    rec = check_artifact(tiny, ArtifactItem("tiny", "bert_encoder", str(user_onnx[0]), "dynamic", "ort-web-webgpu"))
    why = webgpu_missing()
    if why:
        assert rec.verdict is Verdict.SKIPPED and rec.reason == f"runtime ort-web-webgpu: {why}", rec.reason
        pytest.skip(why)
    print(_show(rec))
    assert rec.verdict is Verdict.PASS, rec.reason
    assert rec.audit["webgpu_adapter"]["vendor"] and rec.audit["ort_web"]["execution_provider"] == "webgpu"
    assert rec.audit["placement"]["WebGpuExecutionProvider"]["nodes"] > 0


def test_a_port_stage_with_runtime_ort_web_wasm_runs_in_the_browser(tiny, user_onnx, tmp_path):
    """A port file's stage with `runtime: ort-web-wasm`: the chain runs its artifact in the page; the
    record's port audit and run audit name the runtime and the browser."""
    from harness import pipeline
    from harness.port.chain import port_items
    from harness.verdict import Verdict

    clean, _ = user_onnx
    (tmp_path / "port.yaml").write_text(
        f"name: web_encoder\nstages:\n  - name: encoder\n    artifact: {clean}\n    runtime: ort-web-wasm\n"
        f"    inputs: {{bert_dur: bert_dur}}\n    outputs: {{d_en: d_en}}\n")
    [item] = port_items(tiny, [str(tmp_path / "port.yaml")])
    rec = pipeline.check(tiny, item)
    row = rec.stages[0]["outputs"]["d_en"]["local"]
    print(f"{rec.item_id}: {rec.verdict.value}, rel L2 {row['rel_l2']:.3g} vs the fp32 floor {row['floor_rel_l2']:.3g}")
    assert rec.verdict is Verdict.PASS, rec.reason
    assert rec.audit["port"]["stages"][0]["runtime"] == "ort-web-wasm" and rec.audit["runtime"] == "ort-web-wasm"
    assert "HeadlessChrome" in rec.audit["browser"]["user_agent"]
    assert rec.audit["placement"]["CPUExecutionProvider"]["nodes"] > 0


def test_an_unavailable_browser_runtime_skips_a_users_onnx_with_the_install_command(tiny, tmp_path, monkeypatch):
    from harness.artifacts import ArtifactItem, check_artifact
    from harness.backends.prebuilt import PrebuiltBackend
    from harness.verdict import Verdict

    path = _user_step_onnx(tiny, tmp_path / "mine.onnx")  # SKIPPED before its references are needed
    monkeypatch.setenv("KOKORO_PARITY_WEB_DIR", str(tmp_path))  # a web/ where npm ci never ran
    rec = check_artifact(tiny, ArtifactItem("tiny", "bert_encoder", str(path), "dynamic", "ort-web-webgpu"))
    assert rec.verdict is Verdict.SKIPPED and rec.audit["runtime"] == "ort-web-webgpu", rec.reason
    assert rec.reason == (f"runtime ort-web-webgpu: onnxruntime-web not installed in {tmp_path}/node_modules "
                          f"(npm ci --prefix web)")
    with pytest.raises(ValueError, match="runtime 'ort-web-wasm' runs ONNX files"):
        PrebuiltBackend(tmp_path / "model.pte", "ort-web-wasm")


def test_a_port_stage_names_its_runtime_and_a_browser_runtime_on_a_pte_is_one_error(tmp_path):
    from harness.port.portfile import PortError, load_port

    (tmp_path / "synth.pte").write_bytes(b"not read: the runtime is checked first")
    (tmp_path / "whole.onnx").write_bytes(b"")

    def port(stage_file: str, runtime: str, extra: str = "") -> Path:
        text = (f"name: web\nstages:\n  - name: synth\n    artifact: {stage_file}\n    runtime: {runtime}\n{extra}"
                f"    inputs: {{asr: asr, F0_pred: F0_pred, N_pred: N_pred, ref_s: s_dec}}\n"
                f"    outputs: {{audio: audio}}\n")
        (tmp_path / "port.yaml").write_text(text)
        return tmp_path / "port.yaml"

    with pytest.raises(PortError) as e:
        load_port(port("synth.pte", "ort-web-wasm"))
    assert str(e.value) == (f"port {tmp_path / 'port.yaml'}, stage 'synth', field 'runtime': runtime 'ort-web-wasm' "
                            f"runs ONNX files (onnxruntime-web); synth.pte is a .pte (executorch) artifact, which runs "
                            f"on its native runtime")
    with pytest.raises(PortError, match=r"stage 'synth', field 'runtime': unknown runtime 'webgl'; runtimes: "
                                        r"native, ort-web-wasm, ort-web-webgpu$"):
        load_port(port("whole.onnx", "webgl"))


def test_a_whole_model_onnx_gets_one_item_per_runtime(tmp_path):
    """`--artifact e2e=model.onnx --artifact-runtime native --artifact-runtime ort-web-webgpu`: two
    items, ids with the runtime, the stage of the second's port on the browser runtime."""
    import onnx
    from onnx import TensorProto, helper

    from harness.port.chain import port_items
    from harness.port.portfile import open_port

    graph = helper.make_graph(
        [helper.make_node("Mul", ["style", "speed"], ["waveform"])], "whole",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "tokens"]),
         helper.make_tensor_value_info("style", TensorProto.FLOAT, [1, 256]),
         helper.make_tensor_value_info("speed", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("waveform", TensorProto.FLOAT, [1, "samples"])])
    model = tmp_path / "kokoro.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(model))
    session = type("S", (), {"cases": {"tiny": None}})()
    items = port_items(session, [f"e2e={model}"], runtimes=("native", "ort-web-webgpu"))
    assert [i.id for i in items] == ["tiny-e2e-artifact-kokoro_onnx-dynamic",
                                     "tiny-e2e-artifact-kokoro_onnx@ort-web-webgpu-dynamic"]
    assert not any(i.error for i in items)
    assert open_port(items[1].spec, items[1].runtime).stages[0].runtime == "ort-web-webgpu"
    (tmp_path / "kokoro.pte").write_bytes(b"")
    with pytest.raises(ValueError, match=r"--artifact e2e=.*kokoro.pte: runtime 'ort-web-wasm' runs ONNX files"):
        port_items(session, [f"e2e={tmp_path / 'kokoro.pte'}"], runtimes=("ort-web-wasm",))


def test_each_web_runtime_an_artifact_may_name_is_a_registered_backend():
    """`--artifact-runtime` and a port stage's `runtime:` offer options.WEB_RUNTIMES (spelled where
    no backend is imported): each must be a backend the registry can build."""
    from harness.backends import registry
    from harness.options import WEB_RUNTIMES

    assert WEB_RUNTIMES and set(WEB_RUNTIMES) <= set(registry())


# ---- a page on the user's own device (`kind: browser` targets) -----------------------------------

def _device_target(session, tmp_path: Path, name: str, **spec) -> None:
    """A targets file with one browser target on loopback, used by `session`."""
    fields = ", ".join(f"{k}: {v}" for k, v in {"kind": "browser", **spec}.items())
    (tmp_path / "targets.yaml").write_text(f"targets:\n  {name}: {{{fields}}}\n")
    session.targets_file = str(tmp_path / "targets.yaml")


def _printed_url(capsys, thread, seen: list[str]) -> str:
    """The URL the waiting run prints (its line also kept in `seen`)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and thread.is_alive():
        seen += capsys.readouterr().err.splitlines()
        found = [m.group(1) for m in map(DEVICE_LINE.search, seen) if m]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no URL printed: {seen}")


DEVICE_LINE = re.compile(r"^kokoro-parity: open (http://127\.0\.0\.1:\d+/\S+) on the device \(waiting up to 60 s\)$")
PHONE_UA = "Mozilla/5.0 (Linux; Android 14; Pixel 8) kokoro-parity-test-phone"


@contextlib.contextmanager
def phone_opens(tiny, capsys, target: str, work, lines: list[str], webgpu: bool = False, join_s: float = 120):
    """`work` (items on the device target `target`) in a thread, the URL it prints opened by a
    second headless Chromium with its own user agent, as a phone would: yields that page once the
    work has ended (or `join_s` passed); the target is closed after."""
    from playwright.sync_api import sync_playwright

    from harness.backends.web_page import launch_chromium

    runs = threading.Thread(target=work)
    runs.start()
    try:
        url = _printed_url(capsys, runs, lines)
        with sync_playwright() as p:
            phone = launch_chromium(p, webgpu=webgpu)
            page = phone.new_page(user_agent=PHONE_UA)
            page.goto(url)
            runs.join(timeout=join_s)
            yield page
            phone.close()
    finally:
        runs.join(timeout=120)
        tiny._targets.pop(target).close()


@pytest.mark.slow
def test_a_device_page_opened_by_a_second_browser_runs_the_items_and_the_record_names_it(tiny, user_onnx, tmp_path,
                                                                                          capsys):
    """As a phone would: a second headless Chromium (its own user agent) opens the printed URL once
    and runs a step's item and a user's ONNX (`--artifact-runtime ort-web-wasm`) in turn; a WebGPU
    item where that browser has no adapter, and a backend not onnxruntime-web's, are SKIPPED there."""

    from harness import pipeline
    from harness.artifacts import ArtifactItem
    from harness.runner import Item
    from harness.verdict import Verdict

    _device_target(tiny, tmp_path, "phone", wait_s=60)
    step = Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic", target="phone")
    mine = ArtifactItem("tiny", "bert_encoder", str(user_onnx[0]), "dynamic", "ort-web-wasm", target="phone")
    records, lines = [], []
    gpu = Item("tiny", "bert_encoder", "ort-web-webgpu", "dynamic", target="phone")  # no WebGPU on this "phone"
    start = time.monotonic()
    with phone_opens(tiny, capsys, "phone", lambda: records.extend([tiny.run(step), pipeline.check(tiny, mine),
                                                                     tiny.run(gpu)]), lines) as page:
        assert "3 run(s) done" in page.inner_text("body")
        other = tiny.run(Item("tiny", "bert_encoder", "onnxruntime", "dynamic", target="phone"))
    print(f"device items: {time.monotonic() - start:.1f} s", file=sys.stderr)
    lines += capsys.readouterr().err.splitlines()
    assert len([ln for ln in lines if DEVICE_LINE.search(ln)]) == 1, lines  # one page load, both items
    assert [r.verdict for r in records] == [Verdict.PASS, Verdict.PASS, Verdict.SKIPPED], [r.reason for r in records]
    assert records[1].item_id == "tiny-bert_encoder-artifact-mine_onnx@ort-web-wasm@phone-dynamic"
    assert "the device's browser has no WebGPU" in records[2].reason, records[2].reason
    assert records[2].target["device"]["user_agent"] == PHONE_UA
    for rec in records[:2]:
        assert rec.target["kind"] == "browser" and rec.target["device"]["user_agent"] == PHONE_UA
        assert rec.audit["browser"]["user_agent"] == PHONE_UA and rec.audit["browser"]["device"] is True
        assert rec.audit["placement"]["CPUExecutionProvider"]["nodes"] > 0  # the page's own log, posted back
    assert other.verdict is Verdict.SKIPPED and "onnxruntime-web items only" in other.reason, other.reason


@pytest.mark.slow
def test_a_float16_item_on_a_device_whose_adapter_has_no_shader_f16_is_skipped_naming_it(tiny, tmp_path, capsys):
    """`ort-web-webgpu-fp16` on a browser target: the device's adapter is known only once its page
    runs the file, so onnxruntime-web's own refusal ("requires f16 but the device does not support
    it") is the item's SKIPPED naming shader-f16, not a RUN_ERROR. The "device" is a second headless
    Chromium with WebGPU (SwiftShader: no shader-f16)."""

    from harness.runner import Item
    from harness.verdict import Verdict

    _device_target(tiny, tmp_path, "gpu-phone", wait_s=60)
    records, lines = [], []
    item = Item("tiny", "bert_encoder", "ort-web-webgpu-fp16", "dynamic", target="gpu-phone")
    with phone_opens(tiny, capsys, "gpu-phone", lambda: records.append(tiny.run(item)), lines, webgpu=True,
                     join_s=180):
        pass
    (rec,) = records
    adapter = rec.target["device"]["webgpu_adapter"]
    if "error" in adapter or adapter["shader_f16"]:
        pytest.skip(f"this Chromium's adapter is not the case under test: {adapter}")
    assert rec.verdict is Verdict.SKIPPED, (rec.verdict, rec.reason)
    assert f"the device's WebGPU adapter ({adapter['vendor']} {adapter['architecture']}" in rec.reason, rec.reason
    assert rec.reason.endswith("has no shader-f16: float16 web models need it"), rec.reason


def test_a_device_page_nobody_opens_is_the_items_skip_never_a_pass(tiny, tmp_path, capsys, monkeypatch):
    from harness.backends import web_device
    from harness.runner import Item
    from harness.verdict import Verdict

    monkeypatch.setattr(web_device, "PROGRESS_S", 0.5)
    _device_target(tiny, tmp_path, "nobody", wait_s=2)
    try:
        rec = tiny.run(Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic", target="nobody"))
    finally:
        tiny._targets.pop("nobody").close()
    err = capsys.readouterr().err
    assert rec.verdict is Verdict.SKIPPED and "no browser opened the URL within 2 s" in rec.reason, rec.reason
    assert re.search(r"open http://127\.0\.0\.1:\d+/runner\.html\?device&key=[\w-]+ on the device \(waiting up to 2 s\)", err)
    assert "kokoro-parity: waiting for a browser at http://127.0.0.1:" in err  # the progress line


def test_a_browser_target_listens_on_loopback_unless_its_entry_names_an_address(tmp_path):
    from harness.backends.web_device import DeviceTarget, listen_address
    from harness.plumbing.targets import TargetError, get_target

    path = tmp_path / "targets.yaml"
    path.write_text("targets:\n  phone: {kind: browser}\n  lan: {kind: browser, listen: '0.0.0.0:8765', wait_s: 30}\n"
                    "  bad: {kind: browser, listen: 'a b'}\n")
    with pytest.raises(TargetError, match=r"targets.bad.listen: String should match pattern"):
        get_target("phone", path)
    path.write_text("targets:\n  phone: {kind: browser}\n  lan: {kind: browser, listen: '0.0.0.0:8765', wait_s: 30}\n")
    phone, lan = (get_target(n, path) for n in ("phone", "lan"))
    assert (phone.kind, phone.spec.wait_s, lan.spec.wait_s) == ("browser", 300, 30)
    assert listen_address(phone.spec.listen) == ("127.0.0.1", 0) and listen_address(lan.spec.listen) == ("0.0.0.0", 8765)
    assert listen_address("192.168.1.5") == ("192.168.1.5", 0)
    device = DeviceTarget(phone.name, phone.spec)
    try:
        device.device.start()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/runner\.html\?device&key=[\w-]{16}", device.device.url)
        assert device.describe() == {"name": "phone", "kind": "browser"}
        assert not device.runnable(get_backend("onnxruntime"))[0] and device.runnable(get_backend("ort-web-wasm"))[0]
        assert_only_the_key_is_answered(device.device)
    finally:
        device.close()


def assert_only_the_key_is_answered(device):
    """Without the run's key (in the printed URL, then as the cookie its answer sets) every request
    is refused, a run to take and an answer to post included; with it, the page and its files come."""
    import urllib.error
    import urllib.request

    base = device.server.url
    for path, data in (("/runner.html?device", None), ("/next?page=1", None), ("/runner.js", None),
                       ("/answer/1", b"{}"), (f"/runner.html?device&key={device.key[:-1]}x", None)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(base + path, data=data), timeout=10)
        assert e.value.code == 403, path
    assert not device.server.posted
    with urllib.request.urlopen(device.url, timeout=10) as answer:
        cookie = answer.headers["Set-Cookie"].split(";")[0]
        assert answer.status == 200 and b"runner.js" in answer.read() and cookie.endswith("=" + device.key)
    with urllib.request.urlopen(urllib.request.Request(base + "/runner.js", headers={"Cookie": cookie}), timeout=10) as js:
        assert js.status == 200


def _stuck_page(browser, url: str):
    """A page at `url` (the phone's user agent) whose run never gets its model: it takes the next
    run and hangs inside it, deterministically (the fetch of /model.onnx is never answered)."""
    page = browser.new_page(user_agent=PHONE_UA)
    asked: list[str] = []
    page.route("**/model.onnx*", lambda route: asked.append(route.request.url))  # never fulfilled
    page.goto(url)
    deadline = time.monotonic() + 60
    while not asked:
        assert time.monotonic() < deadline, "the page never fetched the model"
        page.wait_for_timeout(100)
    return page


@pytest.mark.slow
def test_a_device_page_closed_mid_run_is_that_items_crash_within_seconds_and_a_new_page_passes_the_next(
        tiny, tmp_path, capsys):
    """The tab closed (or its renderer gone) while it runs: CRASHED in seconds, not TIMEOUT at the
    run limit; the next item waits for a page again (the URL printed again) and passes in a new one.
    The server's stream handlers end with it."""
    from playwright.sync_api import sync_playwright

    from harness.backends.web_page import launch_chromium
    from harness.runner import Item, Limits
    from harness.verdict import Verdict

    _device_target(tiny, tmp_path, "phone", wait_s=60)
    item = Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic", target="phone")
    records, lines = [], []
    runs = threading.Thread(target=lambda: [records.append(tiny.run(item)) for _ in range(2)])
    limits, tiny.limits = tiny.limits, Limits(run_s=120)
    start = time.monotonic()
    runs.start()
    try:
        url = _printed_url(capsys, runs, lines)
        waited = time.monotonic() - start  # the item's compile (its ONNX export) when it is the first
        with sync_playwright() as p:
            phone = launch_chromium(p, webgpu=False)
            _stuck_page(phone, url).close()
            closed = time.monotonic()
            while not records and time.monotonic() < closed + 60:
                time.sleep(0.05)
            crash_s = time.monotonic() - closed
            while len([ln for ln in lines if DEVICE_LINE.search(ln)]) < 2 and time.monotonic() < closed + 70:
                lines += capsys.readouterr().err.splitlines()  # the URL again, for a new page
                time.sleep(0.05)
            page = phone.new_page(user_agent=PHONE_UA)
            page.goto(url)
            runs.join(timeout=120)
            server = tiny._targets["phone"].device.server
            streams = list(server._streaming)  # the open page's /alive
            tiny._targets.pop("phone").close()
            assert streams and not [t for t in streams if t.is_alive()], "a stream's handler outlived its server"
            phone.close()
    finally:
        tiny.limits = limits
        runs.join(timeout=120)
        if "phone" in tiny._targets:
            tiny._targets.pop("phone").close()
    print(f"URL after {waited:.1f} s; crash seen {crash_s:.1f} s after the tab closed; "
          f"{time.monotonic() - start:.1f} s in all", file=sys.stderr)
    assert len([ln for ln in lines if DEVICE_LINE.search(ln)]) == 2, lines
    crashed, after = records
    assert crashed.verdict is Verdict.CRASHED, crashed.reason
    assert re.search(r"the device's page went away during the run \(tab closed or crashed\) after \d+ s",
                     crashed.reason), crashed.reason
    assert crash_s < 10, crash_s  # GONE_S after the close, not the run limit's 120 s
    assert crashed.target["device"]["user_agent"] == PHONE_UA  # the page that took the run, posted on its load
    assert after.verdict is Verdict.PASS, after.reason
    assert after.target["device"]["user_agent"] == PHONE_UA


@pytest.mark.slow
def test_a_device_page_that_stays_open_and_never_answers_is_the_items_timeout(tiny, tmp_path, capsys):
    from playwright.sync_api import sync_playwright

    from harness.backends.web_page import launch_chromium
    from harness.runner import Item, Limits
    from harness.verdict import Verdict

    _device_target(tiny, tmp_path, "phone", wait_s=60)
    records, lines = [], []
    runs = threading.Thread(target=lambda: records.append(
        tiny.run(Item("tiny", "bert_encoder", "ort-web-wasm", "dynamic", target="phone"))))
    limits, tiny.limits = tiny.limits, Limits(run_s=4)
    runs.start()
    try:
        url = _printed_url(capsys, runs, lines)
        with sync_playwright() as p:
            phone = launch_chromium(p, webgpu=False)
            page = _stuck_page(phone, url)
            while runs.is_alive():
                page.wait_for_timeout(200)  # the page stays open (and its connection with it)
            phone.close()
    finally:
        tiny.limits = limits
        runs.join(timeout=60)
        tiny._targets.pop("phone").close()
    (rec,) = records
    assert rec.verdict is Verdict.TIMEOUT and "the device's page gave no answer after 4 s" in rec.reason, rec.reason
    assert rec.target["device"]["user_agent"] == PHONE_UA


def test_a_device_page_busy_in_a_long_synchronous_run_is_still_there_and_a_closed_one_is_gone(browser_runtime):
    """The page's main thread blocked (as in a long synchronous WebAssembly run) keeps its /alive
    connection: no crash read; the page closed drops it within seconds; the server's stream
    handlers end when it closes."""
    from playwright.sync_api import sync_playwright

    from harness.backends.web_device import GONE_S, Device
    from harness.backends.web_page import launch_chromium

    device = Device("127.0.0.1", 0, wait_s=30)
    device.start()
    try:
        with sync_playwright() as p:
            browser = launch_chromium(p, webgpu=False)
            page = browser.new_page()
            page.goto(device.url)
            page.wait_for_function("() => document.body.textContent.includes('waiting for runs')")
            deadline = time.monotonic() + 10
            while not device._open and time.monotonic() < deadline:
                time.sleep(0.05)
            (page_id,) = device._open
            watched, stop = [], threading.Event()

            def watch():
                while not stop.is_set():
                    watched.append(device._gone(page_id) or not device._open[page_id])
                    time.sleep(0.1)

            watcher = threading.Thread(target=watch)
            watcher.start()
            page.evaluate(f"() => {{ const end = Date.now() + {(GONE_S + 2) * 1000}; while (Date.now() < end) {{}} }}")
            stop.set()
            watcher.join()
            assert watched and not any(watched), "a busy page read as gone"
            streams = list(device.server._streaming)
            page.close()
            closed = time.monotonic()
            while not device._gone(page_id) and time.monotonic() < closed + 10:
                time.sleep(0.05)
            assert device._gone(page_id) and time.monotonic() - closed < GONE_S + 2
            page = browser.new_page()  # a page held open while the server closes
            page.goto(device.url)
            while len(device.server._streaming) < 1 and time.monotonic() < closed + 20:
                time.sleep(0.05)
            streams += list(device.server._streaming)
            device.close()
            assert len(streams) == 2 and not [t for t in streams if t.is_alive()], "a stream's handler outlived its server"
            browser.close()
    finally:
        device.close()
