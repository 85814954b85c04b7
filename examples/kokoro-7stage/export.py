"""Export the 7-stage split of Kokoro from the default model to ONNX and write its port file
(harness/port/splits.py holds the stages: small torch modules around the model's own submodules).

    .venv/bin/python examples/kokoro-7stage/export.py --case ja [--weights random:0] [--out DIR]
    .venv/bin/python examples/kokoro-7stage/export.py --case ja --defect vocoder=gain:1.1   # one stage with a known defect
    pytest --port examples/kokoro-7stage/port.yaml --case ja
"""
from pathlib import Path

from harness.port.export_command import main

if __name__ == "__main__":
    main("kokoro-7stage", Path(__file__).resolve().parent)
