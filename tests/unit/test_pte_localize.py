"""`--bisect` on a `--artifact STEP=model.pte` item (harness/port/pte_stages.py): with the ETRecord
saved at export, the module whose output is wrong is named through ExecuTorch's ETDump (intermediate
outputs) and the ETRecord's debug handles; without one, the item is judged whole and says why."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

STACK_ROOT = ("L__self__", "", "harness.steps.TextEncoderStep")
STACK_TE = ("L__self__kmodel.text_encoder", "kmodel.text_encoder", "kokoro.modules.TextEncoder")


def test_module_stacks_map_to_kokoro_paths_relative_entries_and_repeated_calls(random_model):
    """torch.export writes some entries relative to the calling module (`cnn.1` under
    `kmodel.text_encoder`) and marks a module's later calls `@N`; a user's export of the module
    itself names paths from it."""
    from harness.port.pte_stages import kokoro_chain

    km = random_model.kmodel
    stack = [STACK_ROOT, STACK_TE, ("L__self__cnn.1", "cnn.1", "torch.nn.modules.container.Sequential"),
             ("L__self__cnn.1.0", "cnn.1.0", "torch.nn.modules.conv.Conv1d")]
    assert kokoro_chain(stack, km, "text_encoder") == [
        ("text_encoder", 0), ("text_encoder.cnn.1", 0), ("text_encoder.cnn.1.0", 0)]
    own = [("L__self__", "", "kokoro.modules.TextEncoder"),
           ("L__self__cnn.2@1", "cnn.2", "torch.nn.modules.container.Sequential")]
    assert kokoro_chain(own, km, "text_encoder") == [("text_encoder", 0), ("text_encoder.cnn.2", 1)]
    assert kokoro_chain([STACK_ROOT, ("L__self__nowhere", "nowhere", "x.Y")], km, "text_encoder") == []


def _events_and_handles():
    """Three graph nodes of text_encoder.cnn.0: conv (handle 1), layer norm (2), activation (3),
    then the text encoder's own mask (4)."""
    cnn0 = [STACK_ROOT, STACK_TE, ("L__self__cnn.0", "cnn.0", "torch.nn.modules.container.Sequential")]
    handles = {1: {"pos": 0, "stacks": [cnn0 + [("L__self__cnn.0.0", "cnn.0.0", "torch.nn.modules.conv.Conv1d")]]},
               2: {"pos": 1, "stacks": [cnn0 + [("L__self__cnn.0.1", "cnn.0.1", "kokoro.modules.LayerNorm")]]},
               3: {"pos": 2, "stacks": [cnn0 + [("L__self__cnn.0.2", "cnn.0.2", "torch.nn.LeakyReLU")]]},
               4: {"pos": 3, "stacks": [[STACK_ROOT, STACK_TE]]}}
    x = torch.ones(1, 4, 3)
    op = lambda h, out, delegate=False: {"name": "DELEGATE_CALL" if delegate else "op", "ops": ["aten.x"],  # noqa: E731
                                          "handles": h, "delegate": delegate, "backend": "XnnpackBackend", "out": out}
    return handles, x, op


def test_a_delegate_that_runs_past_a_modules_last_op_hides_it(random_model):
    """A delegate logs only its outputs: a module whose last op sits inside a delegate call with later
    ops has no boundary (said so); a portable op, or a delegate that ends with the module, has one."""
    from harness.port.pte_stages import boundaries, handle_modules

    handles, x, op = _events_and_handles()
    chains = handle_modules(handles, random_model.kmodel, "text_encoder")
    sizes = {p: x.numel() for c in chains.values() for p, _ in c}
    events = [op((1, 2), x, delegate=True), op((3, 4), x, delegate=True)]
    found, why = boundaries(events, handles, chains, sizes)
    assert found == {"text_encoder.cnn.0.1": 0, "text_encoder": 1}
    assert "delegate call with later ops" in why["text_encoder.cnn.0"]
    assert "delegate call with later ops" in why["text_encoder.cnn.0.2"]
    events = [op((1,), x), op((2,), x), op((3,), x), op((4,), torch.ones(5))]
    found, why = boundaries(events, handles, chains, sizes)
    assert found["text_encoder.cnn.0"] == 2 and found["text_encoder.cnn.0.2"] == 2
    assert "outputs 5 values, the reference module 12" in why["text_encoder"]


def test_the_module_a_users_pte_computes_is_found_from_its_module_stacks(random_model):
    """A port's .pte stage names no step: its root is the Kokoro module of the root entry's class
    under which the stacks' paths exist, or Kokoro itself for a wrapper whose paths start at kmodel."""
    from harness.port.pte_stages import stage_root

    own = {1: {"pos": 0, "stacks": [[("L__self__", "", "kokoro.modules.TextEncoder"),
                                     ("L__self__cnn.2", "cnn.2", "torch.nn.modules.container.Sequential")]]}}
    assert stage_root(own, random_model.kmodel) == "text_encoder"
    wrapped = {1: {"pos": 0, "stacks": [[STACK_ROOT, STACK_TE]]}}
    assert stage_root(wrapped, random_model.kmodel) == ""


def test_the_etrecord_is_found_by_step_by_bare_path_or_beside_the_artifact(tmp_path):
    from harness.artifacts import ArtifactItem
    from harness.port.pte_stages import etrecord_for

    pte = tmp_path / "enc.pte"
    pte.write_bytes(b"")
    item = ArtifactItem("c", "text_encoder", str(pte), "dynamic")
    assert etrecord_for(item, []) is None
    assert etrecord_for(item, ["decoder=d.etrecord", "text_encoder=t.etrecord"]).name == "t.etrecord"
    assert etrecord_for(item, ["a.etrecord"]).name == "a.etrecord"
    (tmp_path / "enc.etrecord").write_bytes(b"")
    assert etrecord_for(item, ["decoder=d.etrecord"]) == tmp_path / "enc.etrecord"


# ---- end to end: a .pte with one defect, on the tiny case (slow: references, export, two runs) ----

@pytest.fixture(scope="module")
def tiny_session(tmp_path_factory):
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path_factory.mktemp("tiny-pte"), compile_s=600) as s:
        yield s


def _export_with_a_sign_flip(session, out_dir, module_path: str):
    """text_encoder of the tiny case, portable kernels only (every op logs its output), with the
    output of `module_path` negated during export, and its ETRecord."""
    from executorch.exir import to_edge_transform_and_lower

    from harness.backends import get_backend
    from harness.patches import apply_patches
    from harness.steps import get_step

    inputs = session.traces("tiny").inputs("text_encoder", "dynamic", "float32")
    # the unrolled program: ExecuTorch's numeric gap (Inspector.calculate_numeric_gap) gives no answer
    # inside a `scan` body, which portable lowers by default (scan_lstm)
    km = apply_patches(session.model.kmodel, [p for p in get_backend("portable").patches if p != "scan_lstm"])
    hook = km.get_submodule(module_path).register_forward_hook(lambda m, args, out: -out)
    try:
        with torch.no_grad():
            program = torch.export.export(get_step("text_encoder").module(km), tuple(inputs.values()), strict=False)
    finally:
        hook.remove()
    manager = to_edge_transform_and_lower(program, generate_etrecord=True).to_executorch()
    (out_dir / "enc.pte").write_bytes(manager.buffer)
    manager.get_etrecord().save(str(out_dir / "enc.etrecord.bin"))
    return out_dir / "enc.pte", out_dir / "enc.etrecord.bin"


@pytest.fixture(scope="module")
def flipped(tiny_session, tmp_path_factory):
    """`text_encoder.cnn.1` sign-flipped, exported and lowered once for the module (the tests below
    judge the same program): the .pte and its ETRecord."""
    return _export_with_a_sign_flip(tiny_session, tmp_path_factory.mktemp("flipped"), "text_encoder.cnn.1")


def _copied(files, out_dir):
    """The module's exported files, copied into a test's own directory (nothing else beside them)."""
    import shutil

    return tuple(Path(shutil.copy(f, out_dir / f.name)) for f in files)


@pytest.mark.slow
def test_a_sign_flip_in_one_module_is_named_through_the_etrecord(tiny_session, flipped, tmp_path):
    from harness.artifacts import ArtifactItem, check_artifact
    from harness.port.pte_stages import localize_pte
    from harness.record import read_records
    from harness.verdict import Verdict

    pte, etrecord = _copied(flipped, tmp_path)
    item = ArtifactItem("tiny", "text_encoder", str(pte), "dynamic")
    rec = check_artifact(tiny_session, item)
    assert rec.verdict is Verdict.FAIL, rec.reason
    lines = []
    b = localize_pte(tiny_session, item, rec, etrecord, log=lines.append)
    assert b["kind"] == "pte-etdump" and b["first_stage"] == "text_encoder.cnn.1", "\n".join(lines)
    rows = {r["stage"]: r for r in b["stages"]}
    assert rows["text_encoder.cnn.1"]["chained"]["kind"].startswith("sign flip")
    assert "the defect is in the export" in rows["text_encoder.cnn.1"]["chained"]["kind"]  # runtime = its graph
    assert all(rows[p]["chained"]["ok"] for p in ("text_encoder.embedding", "text_encoder.cnn.0", "text_encoder.cnn.1.0"))
    assert "first mapped module whose error leaves its tolerance: text_encoder.cnn.1" in lines
    assert b["graph_gap_error"] is None  # ExecuTorch's calculate_numeric_gap ran
    written = {r.item_id: r for r in read_records(tiny_session.report_dir / "records")}
    assert written[item.id].bisect["first_stage"] == "text_encoder.cnn.1"

    rec = check_artifact(tiny_session, item)
    b = localize_pte(tiny_session, item, rec, None, log=lines.append)
    assert "judged whole: no ETRecord" in b["error"] and "generate_etrecord=True" in b["error"]


@pytest.mark.slow
def test_bisect_localizes_inside_a_pte_stage_of_a_chain_through_its_etrecord(tiny_session, flipped, tmp_path):
    """A chain whose first stage is the sign-flipped text encoder `.pte` with its ETRecord (the
    port file's `etrecord:`), then a harness step: `--bisect` runs the .pte stage with ETDump fed the
    reference's inputs, finds the Kokoro module it computes from the ETRecord's module stacks, and
    names `enc/text_encoder.cnn.1` (sign flip) among the chain's defects; the step stage says why it
    is judged whole. Without the field and without a file beside the .pte, the stage says how to give one."""
    from harness.port.chain import port_items
    from harness.port.chain_localize import localize_item
    from harness.record import Record
    from harness.verdict import Verdict

    pte, etrecord = _copied(flipped, tmp_path)
    port = tmp_path / "port.yaml"
    port.write_text(PTE_CHAIN.format(etrecord=f"etrecord: {etrecord.name}"))
    (item,) = port_items(tiny_session, [str(port)])
    rec = Record(item.case, item.step, item.backend, item.mode, Verdict.FAIL, "stage 'enc' leaves its floor")
    lines = []
    localize_item(tiny_session, item, rec, log=lines.append)
    b = rec.bisect
    enc = b["stages"]["enc"]
    assert enc["kind"] == "pte-etdump" and enc["root"] == "", "\n".join(lines)  # a step wrapper: paths from kmodel.
    assert enc["first_stage"] == "text_encoder.cnn.1", "\n".join(lines)
    assert "judged whole" in b["stages"]["bert"]["error"]
    (defect,) = b["defects"]
    assert defect["stage"] == "enc" and defect["module"] == "text_encoder.cnn.1" and defect["kind"].startswith("sign flip")
    assert "1 defect inside its stages: enc/text_encoder.cnn.1 (sign flip" in rec.reason

    port.write_text(PTE_CHAIN.format(etrecord=""))
    (item,) = port_items(tiny_session, [str(port)])
    rec = Record(item.case, item.step, item.backend, item.mode, Verdict.FAIL, "")
    localize_item(tiny_session, item, rec, log=lines.append)
    why = rec.bisect["stages"]["enc"]["error"]
    assert "generate_etrecord=True" in why and "`etrecord:`" in why and "enc.etrecord" in why, why


PTE_CHAIN = """name: pte-chain
stages:
  - name: enc
    artifact: enc.pte
    {etrecord}
    inputs: {{input_ids: input_ids, input_lengths: input_lengths, text_mask: text_mask}}
    outputs: {{t_en: t_en}}
  - name: bert
    step: bert
    inputs: {{input_ids: input_ids, attention_mask: attention_mask}}
    outputs: {{bert_dur: bert_dur}}
"""


def test_executorch_dtypes_are_read_from_their_scalar_type_numbers():
    """ExecuTorch's TensorInfo.dtype() gives c10's ScalarType number (an int64 input is `4`): a .pte
    stage's inputs are cast to the dtype it declares, so the number must read as its name."""
    from harness.backends.prebuilt import _et_dtype

    assert [_et_dtype(str(n)) for n in (4, 6, 11, 5)] == ["int64", "float32", "bool", "float16"]
    assert _et_dtype("ScalarType.LONG") == "int64" and _et_dtype("99") == "scalar type 99"
