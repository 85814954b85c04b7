"""Reference traces: every step's inputs and outputs for one case, in both modes and both dtypes.

- The *chain* is Kokoro run step by step on the exact lengths (dynamic mode, fp32, packing as in
  kokoro). It defines every step's inputs.
- Every other trace is teacher-forced from the chain: step S in (mode, dtype) runs on the chain's
  inputs of S, padded to the bucket for `static`, cast for `float64`. So each step's error is its
  own, and the fp32-vs-fp64 difference of S is S's own noise floor (torch's accuracy rule).
- `static` runs with packing disabled, as a static export sees it; its difference from `dynamic`
  on the valid region is the *rewrite drift*.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field

import torch

from . import progress
from .cases import FRAME_BUCKETS, MAX_TOKENS, TOKEN_BUCKETS, Bucket, Case, CaseError
from .metrics.tensor import error_metrics
from .model import SAMPLES_PER_FRAME, LoadedModel, load_voice, phonemize, style_for
from .patches import NOISE_INPUTS, PATCHES, affecting, apply_patches, canonical, graph_code_digest, sample_noise, to_float64
from .plumbing import cache
from .plumbing.files import atomic_write, content_key, tensors_digest
from .plumbing.hooks import registered
from .precision.float16 import FLOOR_VERSION, Float16Mode, Mixed
from .steps import FRAME_UNITS, STAGES, STEPS, Step, build_alignment, get_step
from .plumbing.errors import UsageError

MODES = ("dynamic", "static")
REFERENCE_PATCHES = {"dynamic": ("noise_as_input", "dropout_identity"),
                     "static": ("noise_as_input", "dropout_identity", "no_packing")}
TRACE_VERSION = 4  # bump when the way traces are computed changes: it invalidates cached traces


def numerics() -> str:
    """What a reference's float values depend on beyond the model and case: torch's version, its CPU
    kernels (AVX2 / AVX-512), MKL's and oneDNN's code paths. On an AVX-512 CPU MKL's FFT moves
    Kokoro's torch.stft path by up to 1e-2, and any 1e-7 change of the vocoder's inputs (oneDNN's
    convolutions) moves its audio by ~5e-3 (finding 12), so references cached under one are not
    reused under another (`MKL_ENABLE_INSTRUCTIONS`, `ONEDNN_MAX_CPU_ISA` choose them)."""
    return (f"{torch.__version__};{torch.backends.cpu.get_cpu_capability()};"
            f"mkl={os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'auto')};"
            f"onednn={os.environ.get('ONEDNN_MAX_CPU_ISA', 'auto')}")
SYNTH_BUCKETS = (120, 200, 400, 1200, 1600)  # synthesizer frame buckets: 3, 5, 10, 30 and 40 s of audio


def noise_frames(case: Case) -> int:
    """The vocoder noise is drawn once per case, long enough for its bucket and every synthesizer
    bucket: all of them take prefixes of the same numbers, so valid regions share their noise."""
    return max(case.bucket.frames, *SYNTH_BUCKETS)


# Patches that leave a mode's reference as it is (exactly, or within fp32 noise): a backend whose
# program has them is judged against the plain reference. no_packing is exact on exact lengths at
# batch 1, and already part of the static reference.
NEUTRAL_PATCHES = ("noise_as_input", "dropout_identity", "fold_weight_norm", "no_packing")


@dataclass
class Lengths:
    tokens: int
    frames: int

    def of(self, unit: str) -> int:
        return self.tokens if unit == "tokens" else self.frames * FRAME_UNITS[unit]


@dataclass
class CaseTraces:
    """All references of one case: `io[(step, mode, dtype)] = (inputs, outputs)`."""

    case_id: str
    valid: Lengths  # the exact lengths (dynamic shapes, and the valid region of static outputs)
    bucket: Lengths
    pred_dur: list[int]
    chain: dict[str, torch.Tensor]
    io: dict[tuple[str, str, str], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = field(default_factory=dict)
    # module references a port cuts at, `(path:out|path:in, dtype) -> value` (`module_captures`)
    captures: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def inputs(self, step: str, mode: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
        """The step's inputs, forced from the chain: reading them runs nothing (a step's float64
        references are a whole float64 vocoder run, which an item judged against a patched
        variant never reads: en_long's took 1-2 minutes of `make parity`'s cold run for its inputs)."""
        if dict.__contains__(self.io, (step, mode, dtype)):
            return dict.__getitem__(self.io, (step, mode, dtype))[0]
        return forced_inputs(get_step(step), self, mode, dtype)

    def outputs(self, step: str, mode: str, dtype: str = "float32") -> dict[str, torch.Tensor]:
        return self.io[(step, mode, dtype)][1]

    def valid_region(self, step: str, name: str, value: torch.Tensor) -> torch.Tensor:
        """Slice an output of `step` to the valid (unpadded) region along its unit axes."""
        spec = next(t for t in get_step(step).outputs if t.name == name)
        for axis, unit in spec.axes.items():
            value = value.narrow(axis, 0, self.valid.of(unit))
        return value


def as_outputs(step: Step, result) -> dict[str, torch.Tensor]:
    values = result if isinstance(result, (tuple, list)) else (result,)
    if len(values) != len(step.outputs):
        raise ValueError(f"step {step.name}: expected {len(step.outputs)} outputs, got {len(values)}")
    return {t.name: v.detach() for t, v in zip(step.outputs, values)}


DURATION_STAGE = ("bert", "bert_encoder", "duration_encoder", "duration")


_MODELS: dict[tuple, torch.nn.Module] = {}  # reference_model's copies: one patch set, float32 and float64


def reference_model(model: LoadedModel, patches, dtype: str = "float32") -> torch.nn.Module:
    """Kokoro with `patches` in `dtype`, for reading only, built once per process for the patch set
    last asked for (its float32 and float64 kept together, about 1 GB): a step's references are
    computed one step and one dtype at a time, and each deep copy of the 82M parameters took 2.6 s
    on the 2-core machine, its float64 cast 3.5-4.4 s more, where the step itself (`bert_encoder`, a
    Linear) takes milliseconds. A patch replaced in the registry (a test's fault) is a new key.
    `release_models` frees them (Session.close)."""
    if any(n not in PATCHES for n in patches):
        return apply_patches(model.kmodel, patches)  # raises, naming them
    names = canonical(patches)
    base = (model.digest, id(model.kmodel), names, tuple(id(PATCHES[n]) for n in names))
    if not any(k[:-1] == base for k in _MODELS):
        _MODELS.clear()
    if (*base, "float32") not in _MODELS:
        _MODELS[(*base, "float32")] = apply_patches(model.kmodel, names)
    if (*base, dtype) not in _MODELS:
        _MODELS[(*base, dtype)] = to_float64(copy.deepcopy(_MODELS[(*base, "float32")]))
    return _MODELS[(*base, dtype)]


def release_models() -> None:
    _MODELS.clear()


def run_chain(model: LoadedModel, case: Case, synthesize: bool = True) -> tuple[dict[str, torch.Tensor], Lengths, list[int]]:
    """Kokoro's forward_with_tokens, step by step, keeping every named value (up to the durations
    only when `synthesize` is false: unit tests of the token steps need no vocoder)."""
    km = reference_model(model, REFERENCE_PATCHES["dynamic"])
    ids = case.token_ids(model.vocab)
    n = len(ids)
    v: dict[str, torch.Tensor] = {}
    v["input_ids"] = torch.tensor([ids], dtype=torch.long)
    v["text_mask"] = torch.zeros(1, n, dtype=torch.bool)
    v["attention_mask"] = (~v["text_mask"]).int()
    v["input_lengths"] = torch.tensor([n], dtype=torch.long)
    ref_s = style_for(load_voice(case.voice), n - 2)
    v["s_pred"], v["s_dec"] = ref_s[:, 128:].contiguous(), ref_s[:, :128].contiguous()
    v["speed"] = torch.tensor([case.speed], dtype=torch.float32)

    def call(name: str) -> None:
        step = get_step(name)
        v.update(as_outputs(step, step.module(km)(*(v[i] for i in step.input_names))))

    with torch.no_grad():
        for name in DURATION_STAGE:
            call(name)
        pred_dur, aln, n_frames = build_alignment(v["duration"], n)
        if not synthesize:
            return v, Lengths(n, n_frames), pred_dur.tolist()
        if n_frames > case.bucket.frames:
            raise CaseError(f"case {case.id!r}: {n_frames} predicted frames exceed field 'bucket.frames' "
                            f"= {case.bucket.frames}")
        v["aln"] = aln
        v["en"] = v["d"].transpose(-1, -2) @ aln
        v["frame_lengths"] = torch.tensor([n_frames], dtype=torch.long)
        call("f0n")
        call("text_encoder")
        v["asr"] = v["t_en"] @ aln
        bucket_noise = sample_noise(case.seed, noise_frames(case) * SAMPLES_PER_FRAME)
        for k, t in bucket_noise.items():
            v[k] = t if k == "rand_ini" else t[:, : n_frames * SAMPLES_PER_FRAME].contiguous()
            v[f"bucket_{k}"] = t if k == "rand_ini" else t[:, : case.bucket.frames * SAMPLES_PER_FRAME].contiguous()
            v[f"case_{k}"] = t  # every synthesizer bucket takes its prefix (harness.e2e)
        captured = {}
        hook = km.decoder.generator.register_forward_pre_hook(lambda m, args: captured.update(gen_x=args[0]))
        try:
            call("decoder")
        finally:
            hook.remove()  # the model is shared (reference_model)
        v["gen_x"] = captured["gen_x"].detach()
        call("generator")
    return v, Lengths(n, n_frames), pred_dur.tolist()


def pad_inputs(step: Step, chain: dict[str, torch.Tensor], valid: Lengths, bucket: Lengths) -> dict[str, torch.Tensor]:
    """The step's chain inputs padded to the bucket along their unit axes (noise: the bucket's own)."""
    out = {}
    for spec in step.inputs:
        if spec.name in NOISE_INPUTS:
            out[spec.name] = chain[f"bucket_{spec.name}"]
            continue
        value = chain[spec.name]
        for axis, unit in spec.axes.items():
            extra = bucket.of(unit) - value.shape[axis]
            if extra < 0:
                raise ValueError(f"{spec.name}: {value.shape[axis]} {unit} exceed the bucket's {bucket.of(unit)}")
            if extra:
                shape = list(value.shape)
                shape[axis] = extra
                value = torch.cat([value, torch.full(shape, spec.pad_value, dtype=value.dtype)], dim=axis)
        out[spec.name] = value.contiguous()
    return out


def cast(inputs: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    target = getattr(torch, dtype)
    return {k: (t.to(target) if t.is_floating_point() else t) for k, t in inputs.items()}


def compute_traces(model: LoadedModel, case: Case, steps: tuple[str, ...] | None = None) -> CaseTraces:
    """Every reference of `steps` (default: all) for one case, computed now."""
    traces = _chain_traces(model, case, synthesize=not steps or not set(steps) <= set(DURATION_STAGE))
    traces.io.update(_step_references(model, traces, [s for s in STEPS if not steps or s.name in steps]))
    return traces


def _chain_traces(model: LoadedModel, case: Case, synthesize: bool = True) -> CaseTraces:
    """Kokoro's chain of one case, the inputs every step's references are forced from."""
    with progress.phase("references: Kokoro's chain", subject=case.id):
        chain, valid, pred_dur = run_chain(model, case, synthesize=synthesize)
    return CaseTraces(case.id, valid, Lengths(case.bucket.tokens, case.bucket.frames), pred_dur, chain)


DTYPES = ("float32", "float64")


def forced_inputs(step: Step, traces: CaseTraces, mode: str, dtype: str) -> dict[str, torch.Tensor]:
    """What a step's references are forced from: the chain's values (padded to the bucket in the
    static mode) in `dtype`."""
    base = ({k: traces.chain[k] for k in step.input_names} if mode == "dynamic"
            else pad_inputs(step, traces.chain, traces.valid, traces.bucket))
    return cast(base, dtype)


def _step_references(model: LoadedModel, traces: CaseTraces, steps: list[Step],
                     modes: tuple[str, ...] = MODES, dtypes: tuple[str, ...] = DTYPES) -> dict:
    """The steps' references in `modes` and `dtypes`, each forced from the chain's inputs. Its
    progress: one phase per mode and dtype over many steps, one phase naming the step (and its
    mode and dtype, when one) when it is one (a step's references computed on first read: the lines
    say which, and each one's time is remembered under its own name)."""
    io = {}
    one = steps[0].name if len(steps) == 1 else None
    subject = (f"{traces.case_id} {one}" + (f" {modes[0]}" if len(modes) == 1 else "")
               + (f" {dtypes[0]}" if len(dtypes) == 1 else ""))
    whole = progress.phase("references", subject=subject) if one else contextlib.nullcontext()
    with whole as one_phase:
        for mode in modes:
            for dtype, km in ((d, reference_model(model, REFERENCE_PATCHES[mode], d)) for d in dtypes):
                each = (contextlib.nullcontext(one_phase) if one
                        else progress.phase("references", subject=f"{traces.case_id} {mode} {dtype}"))
                with each as shown:
                    for step in steps:
                        shown.update(step.name if not one else  # what the subject does not already say
                                     " ".join(v for v, many in ((mode, len(modes) > 1), (dtype, len(dtypes) > 1))
                                              if many))
                        inputs = forced_inputs(step, traces, mode, dtype)
                        with torch.no_grad():
                            outputs = as_outputs(step, step.module(km)(*inputs.values()))
                        io[(step.name, mode, dtype)] = (inputs, outputs)
    return io


class StepReferences(dict):
    """`CaseTraces.io` of a cached case: each step's references in one mode and dtype computed (or read from
    the cache) the first time an item asks for them; a read of a value already here does no work
    and shows no progress. A run of one small step does not compute the float64 vocoder first
    (most of a first run's reference time: the first verdict waited on references it never read),
    and a case's padded static bucket is run only for the static items that read it."""

    def __init__(self, model: LoadedModel, case: Case, traces: CaseTraces):
        super().__init__()
        self._model, self._case, self._traces = model, case, traces
        self._names = {s.name for s in STEPS}

    def _known(self, key) -> bool:
        return isinstance(key, tuple) and len(key) == 3 and key[0] in self._names and key[1] in MODES \
            and key[2] in ("float32", "float64")

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or self._known(key)

    def __missing__(self, key):
        if not self._known(key):
            raise KeyError(key)
        self.update(_cached_step_references(self._model, self._case, self._traces, get_step(key[0]), key[1],
                                            key[2]))
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        return self[key] if key in self else default


def _cached_step_references(model: LoadedModel, case: Case, traces: CaseTraces, step: Step, mode: str,
                            dtype: str) -> dict:
    """One dtype at a time: a float32 read (the golden check) never pays for the float64 run."""
    key = content_key("traces-step", TRACE_VERSION, model.digest, case.digest, numerics(), step.name, mode, dtype)

    def build(tmp):
        io = _step_references(model, traces, [step], (mode,), (dtype,))
        atomic_write(tmp / "io.pt", lambda f: torch.save(io, f))

    entry, _hit = cache.get_or_build("traces", key, build)
    return torch.load(entry / "io.pt", weights_only=False)


def load_traces(model: LoadedModel, case: Case) -> CaseTraces:
    """Traces of a case, cached by content (weights, case, torch, trace code): the chain now, each
    step's references when first read (`StepReferences`)."""
    key = content_key("traces-chain", TRACE_VERSION, model.digest, case.digest, numerics())

    def build(tmp):
        traces = _chain_traces(model, case)
        atomic_write(tmp / "traces.pt", lambda f: torch.save(traces.__dict__, f))

    entry, _hit = cache.get_or_build("traces", key, build)
    traces = CaseTraces(**torch.load(entry / "traces.pt", weights_only=False))
    traces.io = StepReferences(model, case, traces)
    return traces


def capture_submodules(module: torch.nn.Module, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every submodule's (first) output by module path, in execution order, via forward hooks;
    bisection feeds these to the backend one module at a time."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for path, sub in module.named_modules():
        if path:
            def hook(m, args, out, path=path):
                first = out[0] if isinstance(out, (tuple, list)) else out
                if isinstance(first, torch.Tensor) and path not in seen:
                    seen[path] = first.detach()
            hooks.append(sub.register_forward_hook(hook))
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


# The step whose teacher-forced run reaches a module path: the first prefix that holds it.
MODULE_STEPS = (("decoder.generator", "generator"), ("decoder", "decoder"), ("bert_encoder", "bert_encoder"),
                ("bert", "bert"), ("predictor.text_encoder", "duration_encoder"), ("predictor.lstm", "duration"),
                ("predictor.duration_proj", "duration"), ("predictor", "f0n"), ("text_encoder", "text_encoder"))


def step_of_module(path: str) -> str | None:
    return next((step for prefix, step in MODULE_STEPS if path == prefix or path.startswith(prefix + ".")), None)


def module_captures(model: LoadedModel, case: Case, traces: CaseTraces, refs, variant: tuple[str, ...] = (),
                    zero_noise: bool = False) -> dict:
    """The values of module references (`decoder.generator.conv_post:out`, `...noise_convs.0:in`)
    in float32 and float64, put in `traces.captures`: forward hooks on those paths during one
    teacher-forced dynamic run per dtype of each step that holds them (the traces' own inputs, so
    the float32 values are the chain's), all of a port's boundaries at once; cached beside the
    traces. Hooks clone: Generator's `xs += ...` mutates a resblock's output after its hook.
    `variant`: extra semantics-changing patches; `zero_noise`: every noise input zero (what an
    artifact that draws no noise computes); give either a copy of the traces with empty captures."""
    refs = tuple(sorted({r for r in refs} - {k[0] for k in traces.captures}))
    if not refs:
        return traces.captures
    key = content_key("captures", TRACE_VERSION, model.digest, case.digest, numerics(), refs,
                      *((variant, graph_code_digest(variant)) if variant else ()),  # `variant`: extra patches
                      *(("zero_noise",) if zero_noise else ()))

    def build(tmp):
        by_step: dict[str, list[str]] = {}
        for ref in refs:
            path = ref.rsplit(":", 1)[0]
            step = step_of_module(path)
            if step is None:
                raise UsageError(f"module reference {ref!r}: no step of the harness runs {path!r}")
            by_step.setdefault(step, []).append(ref)
        out: dict[tuple[str, str], torch.Tensor] = {}
        for dtype in ("float32", "float64"):
            km = reference_model(model, (*REFERENCE_PATCHES["dynamic"], *variant), dtype)
            for step, step_refs in by_step.items():
                hooks = []
                for ref in step_refs:
                    path, which = ref.rsplit(":", 1)
                    sub = km.get_submodule(path)

                    def keep(value, ref=ref, dtype=dtype):
                        first = value[0] if isinstance(value, (tuple, list)) else value
                        if isinstance(first, torch.Tensor) and (ref, dtype) not in out:
                            out[(ref, dtype)] = first.detach().clone()

                    hooks.append(sub.register_forward_pre_hook(lambda m, args, keep=keep: keep(args))
                                 if which == "in" else sub.register_forward_hook(lambda m, a, o, keep=keep: keep(o)))
                with registered(hooks), torch.no_grad(), \
                        progress.phase("references: module captures", subject=f"{case.id} {step} {dtype}"):
                    inputs = traces.inputs(step, "dynamic", dtype)
                    if zero_noise:
                        inputs = {k: torch.zeros_like(v) if k in NOISE_INPUTS else v for k, v in inputs.items()}
                    get_step(step).module(km)(*inputs.values())
        silent = [r for r in refs if (r, "float32") not in out]
        if silent:
            raise UsageError(f"module reference(s) {silent}: the module never ran forward on a tensor in "
                             f"Kokoro's reference (a method such as TorchSTFT.transform is not a forward)")
        atomic_write(tmp / "captures.pt", lambda f: torch.save(out, f))

    entry, _ = cache.get_or_build("traces", key, build)
    traces.captures.update(torch.load(entry / "captures.pt", weights_only=True))
    return traces.captures


def variant_outputs(model: LoadedModel, case: Case, traces: CaseTraces, step: str, mode: str,
                    variant: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """Outputs of `step` (fp32 and fp64) on the mode's inputs with extra semantics-changing patches.

    A backend is judged against the reference *with the patches its export needs*, so its error is
    its own; how far those patches move the model is reported beside it as the patch drift.
    """
    return {"float32": variant_output(model, case, traces, step, mode, variant, "float32"),
            "float64": variant_output(model, case, traces, step, mode, variant, "float64")}


def variant_output(model: LoadedModel, case: Case, traces: CaseTraces, step: str, mode: str,
                   variant: tuple[str, ...], dtype: str) -> dict[str, torch.Tensor]:
    """One precision of `variant_outputs`, computed only when asked for. In float64 a patch that
    writes the same function with other ops (`same_function`: STFT phase by torch.where, float64
    norm statistics, the LSTM as a scan) changes nothing but float64 rounding, so the float64
    output is shared by every patch set with the same function-changing patches: xnnpack's and
    eager's decoder share one float64 run, and a set of only such patches is the trace's own."""
    if dtype == "float64":
        variant = tuple(p for p in variant if not PATCHES[p].same_function)
        if not variant:
            return traces.outputs(step, mode, "float64")
    key = content_key("variant", TRACE_VERSION, model.digest, case.digest, numerics(), step, mode, variant, dtype,
                      graph_code_digest(tuple(variant)) if variant else "")

    def build(tmp):
        km = reference_model(model, (*REFERENCE_PATCHES[mode], *variant), dtype)
        s = get_step(step)
        with progress.phase("references with " + "+".join(variant), subject=f"{case.id} {step} {mode} {dtype}"):
            with torch.no_grad():
                out = as_outputs(s, s.module(km)(*traces.inputs(step, mode, dtype).values()))
        atomic_write(tmp / "outputs.pt", lambda f: torch.save(out, f))

    entry, _ = cache.get_or_build("variants", key, build)
    return torch.load(entry / "outputs.pt", weights_only=True)


def dynamic_counterpart(model: LoadedModel, case: Case, traces: CaseTraces, step: str,
                       variant: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """What a static output is compared with for its rewrite drift: Kokoro's dynamic reference,
    carrying only the semantics-changing patches of `variant` (a preserving patch such as
    length_aware_lstm must be measured against the real packed Kokoro, not against itself)."""
    changing = tuple(p for p in variant if not PATCHES[p].preserves_semantics)
    if not changing:
        return traces.outputs(step, "dynamic", "float32")
    return variant_output(model, case, traces, step, "dynamic", changing, "float32")


def rewrite_drift(model: LoadedModel, case: Case, traces: CaseTraces, variant: tuple[str, ...] = ()) -> list[dict]:
    """Per step output: the static reference (with `variant` patches) against the dynamic one on
    the valid region, beside the static fp32 noise floor. No backend involved."""
    rows = []
    for step in STEPS:
        if affecting(variant, step.name):
            v_step = affecting(variant, step.name)
            static = variant_outputs(model, case, traces, step.name, "static", v_step)
            dynamic32 = dynamic_counterpart(model, case, traces, step.name, v_step)
            s32, s64 = static["float32"], static["float64"]
        else:
            s32, s64 = traces.outputs(step.name, "static", "float32"), traces.outputs(step.name, "static", "float64")
            dynamic32 = traces.outputs(step.name, "dynamic", "float32")
        for name in step.output_names:
            v = lambda t: traces.valid_region(step.name, name, t)  # noqa: E731
            drift = error_metrics(v(s32[name]), dynamic32[name])["rel_l2"]
            floor = error_metrics(v(s32[name]), v(s64[name]))["rel_l2"]
            rows.append({"case": case.id, "step": step.name, "output": name, "lstm": step.lstm,
                         "patches": "+".join(variant) or "-", "drift_rel_l2": drift, "floor_rel_l2": floor,
                         "drift_over_floor": drift / floor if floor else float("inf")})
    return rows


def synthesizer_reference(model: LoadedModel, case: Case, traces: CaseTraces, variant: tuple[str, ...] = ()):
    """The e2e reference audio: the synthesizer in eager PyTorch on the exact lengths and the
    reference alignment, in fp32 and fp64, with the backend's semantics-changing patches."""
    key = content_key("synthesizer", TRACE_VERSION, model.digest, case.digest, numerics(), variant,
                      graph_code_digest(tuple(variant)) if variant else "")
    step = get_step("synthesizer")
    chain = traces.chain

    def build(tmp):
        inputs = {k: chain[k] for k in step.input_names}
        out = {}
        for dtype in ("float32", "float64"):
            km = reference_model(model, (*REFERENCE_PATCHES["dynamic"], *variant), dtype)
            with progress.phase("references: the synthesizer", subject=f"{case.id} {dtype}"), torch.no_grad():
                out[dtype] = step.module(km)(*cast(inputs, dtype).values())
        atomic_write(tmp / "audio.pt", lambda f: torch.save(out, f))

    entry, _ = cache.get_or_build("synthesizer", key, build)
    return torch.load(entry / "audio.pt", weights_only=True)


@dataclass
class References:
    """What one item's outputs are judged against: the reference with the same semantics-changing
    patches as the item's program (`variant`), in fp32 (the floor's candidate) and fp64, the plain
    fp32 reference (for the patch drift) and, static items only, the dynamic fp32 reference on the
    valid region (for the rewrite drift)."""

    fp32: dict[str, torch.Tensor]
    fp64: dict[str, torch.Tensor]
    plain32: dict[str, torch.Tensor]
    dynamic32: dict[str, torch.Tensor] | None
    variant: tuple[str, ...]
    fp16: dict[str, torch.Tensor] | None = None  # float16 eager (harness.precision): the float16 floor


def float16_outputs(model: LoadedModel, case: Case, traces: CaseTraces, step: str, mode: str,
                    variant: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Outputs of `step` in float16 eager (harness.precision: the whole step in float16, float32
    hard-coded in the code included, as the fp16 backend runs a program) on the mode's float32
    inputs, with the reference's patches and `variant`: their error against float64 is the float16
    floor. Computed once per (case, step, mode, variant) and cached."""
    key = content_key("float16", TRACE_VERSION, FLOOR_VERSION, model.digest, case.digest, numerics(), step,
                      mode, variant, graph_code_digest(tuple(variant)) if variant else "")

    def build(tmp):
        km = apply_patches(model.kmodel, (*REFERENCE_PATCHES[mode], *variant))
        with progress.phase("references in float16", subject=f"{case.id} {step} {mode}"):
            s = get_step(step)
            out = as_outputs(s, Mixed(s.module(km), emulate=True)(*traces.inputs(step, mode, "float32").values()))
        atomic_write(tmp / "outputs.pt", lambda f: torch.save(out, f))

    entry, _ = cache.get_or_build("variants", key, build)
    return torch.load(entry / "outputs.pt", weights_only=True)


def references_for(model: LoadedModel, case: Case, traces: CaseTraces, step: str, mode: str,
                   patches, precision: str = "float32") -> References:
    """The one place that picks an item's reference. Patches that are neutral for the mode's
    reference are left out (NEUTRAL_PATCHES), the others make a variant reference, so that a
    backend's error is its own and the patches' effect is reported beside it. A float16 backend
    (`precision="float16"`) also gets the float16 eager outputs, its floor."""
    plain32 = traces.outputs(step, mode, "float32")
    variant = affecting([p for p in patches if p not in REFERENCE_PATCHES[mode] and p not in NEUTRAL_PATCHES], step)
    if variant:
        ref = variant_outputs(model, case, traces, step, mode, variant)
        fp32, fp64 = ref["float32"], ref["float64"]
    else:
        fp32, fp64 = plain32, traces.outputs(step, mode, "float64")
    dynamic32 = dynamic_counterpart(model, case, traces, step, variant) if mode == "static" else None
    fp16 = float16_outputs(model, case, traces, step, mode, variant) if precision == "float16" else None
    return References(fp32, fp64, plain32, dynamic32, variant, fp16)


def fitting_bucket(model, text: str, language: str, voice: str, speed: float = 1.0) -> Bucket:
    """The smallest standard bucket that fits the reference's lengths (tokens with their pads,
    predicted frames): what `new-case` picks when --tokens/--frames are not given."""
    probe = Case(id="probe", language=language, text=text, phonemes=phonemize(text, language), voice=voice,
                 speed=speed, bucket=Bucket(tokens=MAX_TOKENS, frames=4000))
    _, valid, _ = run_chain(model, probe, synthesize=False)
    tokens = next((b for b in TOKEN_BUCKETS if b >= valid.tokens), None)
    frames = next((b for b in FRAME_BUCKETS if b >= valid.frames), None)
    if tokens is None or frames is None:
        raise CaseError(f"{valid.tokens} tokens / {valid.frames} frames fit no standard bucket "
                        f"(at most {TOKEN_BUCKETS[-1]} tokens, {FRAME_BUCKETS[-1]} frames): split the text")
    return Bucket(tokens=tokens, frames=frames)


# ---- a port stage's own reference: its outputs recomputed from its inputs (harness.port.chain) ----

STAGE_REF_VERSION = 2  # bump when stage_reference's computation changes
# the case's own inputs: a stage that does not declare one gets the reference's (padded like its inputs)
CASE_INPUTS = ("input_ids", "attention_mask", "text_mask", "input_lengths", "s_pred", "s_dec", "speed",
               "frame_lengths", *NOISE_INPUTS)
STAGE_GLUE = {"en": ("d", "aln"), "asr": ("t_en", "aln")}  # host glue a stage may run inside itself


class BoundaryError(UsageError):
    """A stage's outputs cannot be recomputed from its inputs (e.g. it starts inside a module)."""


def _stage_plan(have: set[str], wanted: tuple[str, ...]) -> list[tuple[str, str]]:
    """The reference computation from `have` to `wanted`: [("step", name) | ("glue", tensor)], in
    order; a module reference is produced by the step that runs its module (hooks); a step that
    the inputs alone feed is preferred to a chain of smaller ones. Raises BoundaryError naming what
    no computation from the inputs reaches."""
    plan: list[tuple[str, str]] = []
    done = set(have)

    def reach(name: str, seen: frozenset) -> bool:
        if name in done:
            return True
        if name in seen:
            return False
        seen = seen | {name}
        if name in STAGE_GLUE:
            if all(reach(d, seen) for d in STAGE_GLUE[name]):
                plan.append(("glue", name))
                done.add(name)
                return True
            return False
        if ":" in name:
            producers = [get_step(step_of_module(name.rsplit(":", 1)[0]) or "")] \
                if step_of_module(name.rsplit(":", 1)[0]) else []
        elif name == "gen_x":
            producers = [get_step("decoder")]
        else:
            producers = [s for s in (*STEPS, *STAGES) if name in s.output_names]
            # a step fed by the stage's inputs alone first: the synthesizer, not f0n + decoder, from
            # (d, aln, frame_lengths, ...), since only the fused step gives its modules the lengths
            # (provide_frame_lengths), and a length-aware program must be judged length-aware
            producers.sort(key=lambda s: not set(s.input_names) <= have)
        for step in producers:
            if all(reach(i, seen) for i in step.input_names):
                if ("step", step.name) not in plan:
                    plan.append(("step", step.name))
                done.update(step.output_names)
                done.add(name)
                return True
        return False

    missing = [w for w in wanted if not reach(w, frozenset())]
    if missing:
        starts = sorted(n for n in have if ":" in n)
        raise BoundaryError(f"{', '.join(missing)} cannot be recomputed from the stage's inputs"
                            + (f" (it starts inside a module: {', '.join(starts)})" if starts else ""))
    return plan


def _digest(values: dict[str, torch.Tensor]) -> str:
    return tensors_digest(values)


def stage_reference(model: LoadedModel, case: Case, inputs: dict[str, torch.Tensor], outputs: tuple[str, ...],
                    mode: str = "dynamic", precisions: tuple[str, ...] = ("float32", "float64"),
                    variant: tuple[str, ...] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """{precision: {output: value}}: a port stage's outputs recomputed by Kokoro's reference (the
    harness steps and host glue, `_stage_plan`) from the stage's own float32 inputs, e.g. padded to
    the bucket the stage ran (`mode="static"`: the static reference's patches) — the reference a
    bucketed stage is judged against, since Kokoro is not padding-invariant. `float16`: eager float16
    (harness.precision.float16.Mixed, emulated), its error against float64 the stage's float16
    floor. One run per (case, inputs, precision), cached by content (the inputs' bytes in the key)."""
    plan = _stage_plan(set(inputs), outputs)
    key = content_key("stage", TRACE_VERSION, STAGE_REF_VERSION, FLOOR_VERSION, model.digest, case.digest,
                      numerics(), mode, _digest(inputs), outputs, precisions, variant,
                      graph_code_digest(tuple(variant)) if variant else "")

    def build(tmp):
        km32 = apply_patches(model.kmodel, (*REFERENCE_PATCHES[mode], *variant))
        out = {}
        for precision in precisions:
            km = to_float64(copy.deepcopy(km32)) if precision == "float64" else km32
            values = cast(inputs, "float64" if precision == "float64" else "float32")
            captured: dict[str, torch.Tensor] = {}
            with progress.phase("references: a port stage", subject=f"{case.id} {mode} {precision}"), \
                    torch.no_grad():
                for kind, name in plan:
                    if kind == "glue":
                        a, b = (values[d] for d in STAGE_GLUE[name])
                        if precision == "float16":
                            with Float16Mode(torch.float16, True):
                                values[name] = (a.transpose(-1, -2) if name == "en" else a) @ b
                        else:
                            values[name] = (a.transpose(-1, -2) if name == "en" else a) @ b
                        continue
                    step = get_step(name)
                    run = step.module(km)
                    if precision == "float16":
                        mixed = Mixed(run, emulate=True)
                        run, root = mixed, mixed.module.kmodel
                    else:
                        root = run.kmodel
                    hooks = _capture_hooks(root, [o for o in outputs if ":" in o or o == "gen_x"], captured)
                    try:
                        values.update(as_outputs(step, run(*(values[i] for i in step.input_names))))
                    finally:
                        for h in hooks:
                            h.remove()
                    values.update(captured)
            out[precision] = {o: values[o].float() if precision == "float16" else values[o] for o in outputs}
        atomic_write(tmp / "outputs.pt", lambda f: torch.save(out, f))

    entry, _ = cache.get_or_build("variants", key, build)
    return torch.load(entry / "outputs.pt", weights_only=True)


def _capture_hooks(root: torch.nn.Module, refs: list[str], into: dict[str, torch.Tensor]) -> list:
    """Forward hooks that keep the first value of each module reference (`path:out` / `path:in`;
    `gen_x`: the generator's input), cloned (Generator's `xs += ...` mutates after the hook)."""
    hooks = []
    for ref in refs:
        path, which = ("decoder.generator", "in") if ref == "gen_x" else ref.rsplit(":", 1)
        sub = root.get_submodule(path)

        def keep(value, ref=ref):
            first = value[0] if isinstance(value, (tuple, list)) else value
            if isinstance(first, torch.Tensor) and ref not in into:
                into[ref] = first.detach().clone()

        hooks.append(sub.register_forward_pre_hook(lambda m, args, keep=keep: keep(args)) if which == "in"
                     else sub.register_forward_hook(lambda m, a, o, keep=keep: keep(o)))
    return hooks
