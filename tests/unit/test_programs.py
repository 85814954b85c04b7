"""One program key: the runner and the bisection get an item's program through the same function
(programs.ensure_program), so a bisection reuses the item's program, and an edit to a patch's
source makes both export again (a bisection once keyed programs without the patch sources and
could run on a stale program after such an edit)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.patches import PATCHES, Patch, graph_code_digest
from harness.plumbing.cache import CACHE_ENV


@pytest.fixture
def patch_source(tmp_path, monkeypatch):
    """`patch_source(name)`: the real patch `name` gets one more source file, one this test edits
    (the export child applies the real patch; only the parent's key reads the sources)."""
    def add(name: str) -> Path:
        source = tmp_path / f"{name}_source.py"
        source.write_text("# version 1\n")
        p = PATCHES[name]
        monkeypatch.setitem(PATCHES, name, Patch(p.name, p.preserves_semantics, p.apply, p.why, p.affects,
                                                 (*p.sources, str(source))))
        graph_code_digest.cache_clear()
        return source

    yield add
    graph_code_digest.cache_clear()


def _session(tmp_path, random_model):
    from harness.runner import Limits
    from harness.verdict import Profile

    inputs = {"bert_dur": torch.randn(1, 8, 768, generator=torch.Generator().manual_seed(0))}
    traces = SimpleNamespace(inputs=lambda step, mode, dtype: inputs)
    return SimpleNamespace(weights="random:0", model=random_model, limits=Limits(), profile=Profile(),
                           report_dir=tmp_path / "reports", counts=Counter(), traces=lambda case: traces,
                           patches_for=lambda backend: list(backend.patches)), inputs


def test_bisection_shares_the_items_program_and_reexports_after_a_patch_edit(tmp_path, monkeypatch, random_model,
                                                                           patch_source):
    from harness.backends import get_backend
    from harness.bisect import Bisector
    from harness.programs import ensure_program
    from harness.runner import Item

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    edited_patch = patch_source("dropout_identity")  # an eager patch that affects every step
    session, inputs = _session(tmp_path, random_model)
    item = Item("c", "bert_encoder", "eager", "dynamic")
    patches = session.patches_for(get_backend("eager"))

    # the runner's export of the item
    entry, key, result = ensure_program("random:0", random_model.digest, "bert_encoder", inputs, patches, 600,
                                        session.counts)
    assert result is not None and result.ok and session.counts["exports"] == 1

    # the bisection finds the very same program: no second export
    b = Bisector.for_item(session, item, depth=0)
    assert b.program_key == key and session.counts["exports"] == 1 and session.counts["programs_hits"] == 1

    # the patch's source is edited (a new run: the digest is computed afresh): both re-export
    edited_patch.write_text("# version 2: the patch changed\n")
    graph_code_digest.cache_clear()
    b2 = Bisector.for_item(session, item, depth=0)
    assert b2.program_key != key and session.counts["exports"] == 2
    entry2, key2, result2 = ensure_program("random:0", random_model.digest, "bert_encoder", inputs, patches, 600,
                                           session.counts)
    assert key2 == b2.program_key and result2 is None  # the runner now shares the bisection's new program


def test_a_patch_that_cannot_change_the_step_is_not_keyed(random_model, patch_source):
    """no_packing affects the LSTM steps only: editing it leaves the decoder's program key alone."""
    from harness.programs import program_key

    edited_patch = patch_source("no_packing")
    inputs = {"x": torch.zeros(1, 2)}
    decoder_key, keyed = program_key("decoder", inputs, ["no_packing"], random_model.digest)
    assert keyed == []
    edited_patch.write_text("# edited\n")
    graph_code_digest.cache_clear()
    assert program_key("decoder", inputs, ["no_packing"], random_model.digest)[0] == decoder_key
    lstm_key = program_key("duration_encoder", inputs, ["no_packing"], random_model.digest)[0]
    edited_patch.write_text("# edited again\n")
    graph_code_digest.cache_clear()
    assert program_key("duration_encoder", inputs, ["no_packing"], random_model.digest)[0] != lstm_key
