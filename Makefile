# kokoro-parity: `make parity` installs and runs the main job; `make test` runs the test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install parity matrix test bench clean-cache

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[all]"
	touch $(STAMP)

install: $(STAMP)

# The main job: Kokoro's decoder on ExecuTorch+XNNPACK and the eager control, every shipped case,
# both modes, on the default model (rebuilt once from the packaged int8 ONNX).
parity: install
	$(BIN)/pytest --backend=xnnpack --backend=eager -k decoder $(ARGS)

# Every step x every installed backend x both modes (LSTM lowerings take minutes each).
matrix: install
	$(BIN)/pytest $(ARGS)

test: install
	$(BIN)/pytest tests/unit $(ARGS)

clean-cache: install
	$(BIN)/kokoro-parity cache clear
