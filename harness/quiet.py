"""Third-party noise kept out of what the user reads: warnings and log records that the runtimes
and Kokoro emit on every run and that say nothing about the user's models or results.

A newcomer reads a FutureWarning before the first line of `kokoro-parity` as an error. The pytest
plugin and the CLI both call `quiet()` at their entry; `python -W ...` or PYTHONWARNINGS still
shows the warnings (the user asked for them).
"""
from __future__ import annotations

import logging
import sys
import warnings

# Loggers whose records say nothing to a user of this tool but fill every failing item's report:
# torch's structured-trace channel (empty DEBUG lines), torchao's missing optional kernels, and
# torch's pytree deprecation notices (both at import of executorch).
QUIET_LOGGERS = {"torch.__trace": None, "torchao": logging.ERROR, "torchao.kernel.intmm": logging.ERROR,
                 "torch.utils._pytree": logging.ERROR}

# (category, module regex): warnings raised by Kokoro's own model code through torch when a KModel
# is built (its weight_norm convolutions, its one-layer LSTMs with dropout=0.2): the harness folds
# weight_norm and runs without dropout, so neither says anything about a run.
QUIET_WARNINGS = ((FutureWarning, r"torch\.nn\.utils\.weight_norm"),
                  (UserWarning, r"torch\.nn\.modules\.rnn"))


def quiet_logs() -> None:
    for name, level in QUIET_LOGGERS.items():
        logger = logging.getLogger(name)
        if level is None:
            logger.propagate = False
        else:
            logger.setLevel(level)


def quiet_warnings() -> None:
    if sys.warnoptions:  # -W or PYTHONWARNINGS: the user's choice wins
        return
    for category, module in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", category=category, module=module)


def quiet() -> None:
    quiet_logs()
    quiet_warnings()
