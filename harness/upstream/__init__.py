"""Upstream repro bundles: one directory per runtime defect the matrix found, for a bug report.

Each bundle under docs/upstream/<runtime>-<short-name>/ is built from a minimal program (a few-op
module that reproduces the defect, written after the Kokoro source line where the matrix met it)
and holds `program.pt2` (torch.export), `inputs.pt`, the float64 `expected.pt`, `repro.py`,
`ENV.md` and `REPORT.md` (written as the runtime's issue template asks). `repro.py` imports only
torch, numpy and the runtime's own package, and exits

- 1 while the defect reproduces (the converter's error carries the defect's signature; the op
  stays outside the delegate; float16 turns the output non-finite),
- 0 once it is fixed (converts and, where it can run here, matches the float64 expected output),
- 2 when it cannot run here (the runtime's package is not installed),
- 3 when it fails differently (the signature is gone but something else breaks: read it).

`kokoro-parity upstream` (`make upstream`) regenerates every bundle, runs each repro.py in a fresh
interpreter that cannot import kokoro or this harness, rewrites docs/upstream/README.md with the
status on the installed versions (`--only NAME`: that defect's row, dated; the other rows kept),
and fails when a defect does not reproduce. `check_bundles`
(the nightly re-check) only runs the existing bundles' repro.py.

The defects are data (catalog.yaml, read by catalog.py), their minimal programs and runtime checks
live in programs.py and checks/ (read as source), the report texts in templates/, and bundle.py writes and runs.
"""
from .bundle import (BLOCKED, CANNOT_RUN, CHANGED, FIXED, REPRODUCED, STATUS, build_bundle, check_bundles,
                     default_dir, main, readme_md, readme_row, report_md, repro_source, run_isolated,
                     update_readme_rows)
from .catalog import BY_NAME, DEFECTS, SEARCHED, Defect, load_catalog

__all__ = ["BLOCKED", "BY_NAME", "CANNOT_RUN", "CHANGED", "DEFECTS", "FIXED", "REPRODUCED", "SEARCHED", "STATUS",
           "Defect", "build_bundle", "check_bundles", "default_dir", "load_catalog", "main", "readme_md",
           "readme_row", "report_md", "repro_source", "run_isolated", "update_readme_rows"]
