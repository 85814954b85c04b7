"""Shared fixtures for the unit tests: a seeded random Kokoro (fast) and small decoder inputs."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# MKL's AVX-512 FFT (torch.stft / istft on the CPU) rounds differently from its AVX2 one, and on
# Kokoro's padded STFT frames that difference is not small: the synthesizer on a bucket is 2.9 %
# from its exact-length run on an AVX-512 machine (1e-7 with AVX2), and the golden files and
# padded-equals-exact checks were recorded on AVX2. The tests test the harness, so they pin MKL's
# path (before torch's first FFT; child processes inherit it). Finding 12, docs/findings.md.
os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")  # torch's own kernels too (read at its first dispatch)
# One torch thread per process: the suite runs two xdist workers on two cores, each with job
# children, and a pool of one thread per core in every process oversubscribes them (a float64
# decoder forward pass in two processes at once: 104 s with two threads each, 41 s with one;
# `python benchmarks/threads.py`, docs/performance.md). Children inherit the variables.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from harness.plumbing.heap import return_freed_memory  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # the plugin may have imported torch first


HERE = os.path.dirname(os.path.abspath(__file__))
# One directory per test run for the reference kinds of the cache: computing the tiny case's
# references takes minutes on a busy 2-core machine, and a dozen modules used to each compute them
# into their own cache. xdist's workers inherit it from the controller (which made it and removes it).
# The same directory holds the run's shared programs and artifacts (`shared_references(work=True)`).
REFERENCES_ENV = "KOKORO_PARITY_TEST_REFERENCES"
REFERENCE_KINDS = ("weights", "traces", "variants", "synthesizer")
WORK_KINDS = ("programs", "artifacts")
_MADE_HERE = []


def pytest_configure(config):
    if not os.environ.get(REFERENCES_ENV):
        os.environ[REFERENCES_ENV] = tempfile.mkdtemp(prefix="kokoro-parity-test-references-")
        _MADE_HERE.append(os.environ[REFERENCES_ENV])


def pytest_unconfigure(config):
    while _MADE_HERE:
        shutil.rmtree(_MADE_HERE.pop(), ignore_errors=True)
        os.environ.pop(REFERENCES_ENV, None)


def shared_references(cache, work: bool = False) -> Path:
    """A fresh cache directory whose references (rebuilt weights, traces, patched and padded
    references: content-addressed, built under the cache's file locks) are the test run's shared
    ones, so that its programs, artifacts and runs are its own while no reference is computed twice.

    With `work`, its exported programs and compiled artifacts are the run's shared ones too (keyed by
    their content and the backend's version, a test backend's injected fault included): for tests
    that check what an item's program does, not that it was made. A test that counts exports,
    compiles or cache misses, lists or deletes cache entries, keeps its own (the default)."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    shared = os.environ.get(REFERENCES_ENV)
    for kind in (*REFERENCE_KINDS, *(WORK_KINDS if work else ())) if shared else ():
        (Path(shared) / kind).mkdir(parents=True, exist_ok=True)
        (cache / kind).symlink_to(Path(shared) / kind, target_is_directory=True)
    return cache


DURATIONS = Path(HERE) / "durations.json"  # seconds per module, measured (benchmarks/ci_time.py --write-durations)


def module_seconds(items) -> dict:
    """Each module's measured seconds; a module not measured yet: 30 s per `slow` test, 0.5 s per other."""
    measured = json.loads(DURATIONS.read_text())["modules"] if DURATIONS.is_file() else {}
    tests, slow = {}, {}
    for it in items:
        tests[it.path] = tests.get(it.path, 0) + 1
        slow[it.path] = slow.get(it.path, 0) + (it.get_closest_marker("slow") is not None)
    return {path: measured.get(path.name, 30.0 * slow[path] + 0.5 * (tests[path] - slow[path])) for path in tests}


def pytest_collection_modifyitems(config, items):
    """xdist's queue in two halves of about equal measured seconds, each module whole (its
    module-scoped sessions are built once) and the heaviest modules first in each half.
    `--dist worksteal` hands each worker one half of the queue by count; the half with more tests
    goes first, so what spills over is its lightest modules, at the other worker's start; an idle
    worker steals from the end of the other's queue, where the light modules are. Neither core waits
    out a long test that started late (ordered by the count of `slow` tests, the last one of a
    module measured at 110 s ran alone at the end: docs/performance.md)."""
    if not items or not all(str(it.path).startswith(HERE + os.sep) for it in items):
        return  # beside other directories' items (the parity items sort themselves): leave the order
    seconds = module_seconds(items)
    bins = ([], [])
    for path in sorted(seconds, key=lambda p: (-seconds[p], str(p))):  # longest first, into the lighter half
        min(bins, key=lambda b: sum(seconds[p] for p in b)).append(path)
    count = {path: sum(it.path == path for it in items) for path in seconds}
    bins = sorted(bins, key=lambda b: -sum(count[p] for p in b))
    rank = {path: i for i, path in enumerate(p for b in bins for p in b)}
    items.sort(key=lambda it: rank[it.path])  # stable: a module's tests keep their order


@pytest.hookimpl(trylast=True)  # after the fixtures' teardown: what they held is freed by then
def pytest_runtest_teardown(item, nextitem):
    """The heap's freed pages back to the system after every test: a worker runs some 340 tests, and
    without it glibc kept what they had freed until a worker was killed for memory (9.8 GB)."""
    return_freed_memory()


TEST_SEED = 0  # the seed of every Session of the tests (`--weights=random:0`)


@pytest.fixture(scope="session", autouse=True)
def one_test_model_per_process():
    """`load_random(TEST_SEED)` built once per test process: most of the tests' Sessions load
    `random:0` in this process, and building its 82M random parameters takes seconds each on a busy
    2-core machine. The harness only ever patches a deep copy of a loaded model, so one instance
    serves them all, as the `random_model` fixture always has. Other seeds are built on each call
    (test_model checks that two loads of one seed are equal)."""
    from harness import model

    build = model.load_random
    built = {}

    def load_random(seed: int = 0):
        if seed != TEST_SEED:
            return build(seed)
        if seed not in built:
            built[seed] = build(seed)
        return built[seed]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "load_random", load_random)
        yield


@pytest.fixture(scope="session")
def random_model():
    from harness.model import load_random

    return load_random(TEST_SEED)


@pytest.fixture(scope="session")
def decoder_inputs():
    """Decoder inputs for 12 frames (7,200 samples), deterministic."""
    g = torch.Generator().manual_seed(1)
    frames = 12
    asr = torch.randn(1, 512, frames, generator=g)
    f0 = 150 + 50 * torch.rand(1, 2 * frames, generator=g)
    f0[:, :4] = 0  # an unvoiced stretch, so both noise branches matter
    n = torch.randn(1, 2 * frames, generator=g)
    s = torch.randn(1, 128, generator=g)
    return asr, f0, n, s, frames


def _plugins_left_out() -> str:
    """pyproject's `-p no:NAME` options: the third-party plugins no test uses (executorch installs
    them), left out of a child pytest run in a directory of its own too (a user's project)."""
    import shlex
    import tomllib

    pyproject = tomllib.loads((Path(HERE).parents[1] / "pyproject.toml").read_text())
    words = shlex.split(pyproject["tool"]["pytest"]["ini_options"]["addopts"])
    left_out = [w for p, w in zip(words, words[1:]) if p == "-p" and w.startswith("no:") and w != "no:cacheprovider"]
    return " ".join(f"-p {w}" for w in left_out)


def child_pytest_env(**extra: str) -> dict:
    """The environment for a pytest run in a child process: without this run's PYTEST_* and xdist
    variables or a PYTHONPATH a test left behind, so the child is a plain, fresh invocation (but for
    the unused plugins pyproject leaves out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    return {**env, "PYTEST_ADDOPTS": _plugins_left_out(), **extra}


@contextlib.contextmanager
def tiny_session_at(root, work: bool = True, **limits):
    """A Session on the seeded random model and the short `tiny` case (speed 4: few frames), with
    its own case directory and cache under `root`: what the end-to-end tests of several files run.
    The references are the test run's shared ones, and so (`work`) are its exported programs and
    compiled artifacts: several modules' sessions judge the same tiny programs on the same backends
    (the browser's and a target's ONNX of one step, for one). `work=False` for a session whose tests
    count its exports or delete its cache entries."""
    from harness.cases import load_cases, write_case
    from harness.plumbing.cache import CACHE_ENV
    from harness.runner import Limits, Session

    write_case(root / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(shared_references(root / "cache", work=work)))
        s = Session(weights="random:0", case_ids=["tiny"], report_dir=root / "reports", limits=Limits(**limits))
        s._cases = {c.id: c for c in load_cases(root / "cases")}
        try:
            yield s
        finally:
            s.close_browsers()  # its Chromiums (harness.backends.web_page.SharedBrowser): none outlives the module
