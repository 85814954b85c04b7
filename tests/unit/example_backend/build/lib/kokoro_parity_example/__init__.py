"""An example third-party backend: the exported program run node by node by torch.fx's Interpreter.

A backend is a class with a name, an availability check, `compile` (program file -> artifact in
out_dir, returning an audit dict) and `run` (artifact, list of tensors -> list of tensors).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from harness.backends import Backend


class InterpreterBackend(Backend):
    name = "example-interpreter"
    requires = ("torch",)
    patches = ("noise_as_input", "dropout_identity", "fold_weight_norm", "no_packing", "custom_stft")
    artifact_name = "program.pt2"
    description = "example third-party backend: torch.fx.Interpreter over the exported program"

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        shutil.copyfile(program_path, out_dir / self.artifact_name)
        return {"example": "copied the program"}

    def run(self, artifact_path: Path, inputs: list) -> list:
        import torch
        import torch.fx

        module = torch.export.load(str(artifact_path)).module()
        with torch.no_grad():
            out = torch.fx.Interpreter(module).run(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]
