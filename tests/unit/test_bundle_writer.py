"""plumbing.bundle: one writer for every repro bundle; a bundle is whole or absent."""
from __future__ import annotations

import json
import stat

import pytest

from harness.plumbing.bundle import bundle_info, write_bundle_dir


def test_a_bundle_holds_its_files_and_meta_and_a_failed_write_keeps_the_last_one(tmp_path):
    src = tmp_path / "program.bin"
    src.write_bytes(b"\x00\x01")
    out = tmp_path / "repro" / "item"
    write_bundle_dir(out, {"program.bin": src, "repro.py": "print('hi')\n", "raw.bin": b"abc",
                           "expected.txt": lambda p: p.write_text("1.0")}, meta={"stage": "decoder.generator"})
    info = bundle_info(out)
    assert info["files"] == ["expected.txt", "meta.json", "program.bin", "raw.bin", "repro.py"]
    assert info["bytes"] == sum((out / f).stat().st_size for f in info["files"])
    assert json.loads((out / "meta.json").read_text()) == {"stage": "decoder.generator"}
    assert all(stat.S_IMODE((out / f).stat().st_mode) == 0o644 for f in info["files"])

    def broken(path):
        path.write_text("half")
        raise RuntimeError("the writer failed half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        write_bundle_dir(out, {"repro.py": "new", "expected.txt": broken})
    assert (out / "repro.py").read_text() == "print('hi')\n"  # the last whole bundle, untouched
    assert [p.name for p in out.parent.iterdir()] == ["item"]  # no partial directory left beside it

    write_bundle_dir(out, {"repro.py": "new"})
    assert bundle_info(out)["files"] == ["repro.py"]  # replaced, not merged
