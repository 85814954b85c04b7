"""`eager`: the exported program run by PyTorch itself. The control: its error is what the export
and the patches cost, before any runtime is involved."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from . import Backend


class EagerBackend(Backend):
    name = "eager"
    requires = ("torch",)
    artifact_name = "program.pt2"
    description = "torch.export program run by PyTorch (the control)"

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        shutil.copyfile(program_path, out_dir / self.artifact_name)
        return {}

    def repro_source(self) -> str:
        return '''def run_backend(program, inputs):
    """PyTorch itself (torch.export program, eager kernels)."""
    with torch.no_grad():
        out = program.module()(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]
'''

    def run(self, artifact_path: Path, inputs: list) -> list:
        module = torch.export.load(str(artifact_path)).module()
        with torch.no_grad():
            out = module(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]
