"""Shared fixtures for the unit tests: a seeded random Kokoro (fast) and small decoder inputs."""
from __future__ import annotations

import contextlib
import os

# MKL's AVX-512 FFT (torch.stft / istft on the CPU) rounds differently from its AVX2 one, and on
# Kokoro's padded STFT frames that difference is not small: the synthesizer on a bucket is 2.9 %
# from its exact-length run on an AVX-512 machine (1e-7 with AVX2), and the golden files and
# padded-equals-exact checks were recorded on AVX2. The tests test the harness, so they pin MKL's
# path (before torch's first FFT; child processes inherit it). Finding 12, docs/findings.md.
os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")  # torch's own kernels too (read at its first dispatch)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def random_model():
    from harness.model import load_random

    return load_random(0)


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


def child_pytest_env(**extra: str) -> dict:
    """The environment for a pytest run in a child process: without this run's PYTEST_* and xdist
    variables or a PYTHONPATH a test left behind, so the child is a plain, fresh invocation."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    return {**env, **extra}


@contextlib.contextmanager
def tiny_session_at(root, **limits):
    """A Session on the seeded random model and the short `tiny` case (speed 4: few frames), with
    its own case directory and cache under `root`: what the end-to-end tests of several files run."""
    from harness.cases import load_cases, write_case
    from harness.plumbing.cache import CACHE_ENV
    from harness.runner import Limits, Session

    write_case(root / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(root / "cache"))
        s = Session(weights="random:0", case_ids=["tiny"], report_dir=root / "reports", limits=Limits(**limits))
        s._cases = {c.id: c for c in load_cases(root / "cases")}
        yield s
