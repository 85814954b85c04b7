"""kokoro-parity: a numerical parity harness for Kokoro-82M on on-device runtimes.

Importing this package is cheap on purpose: torch, kokoro and the runtimes are imported by the
modules that need them, so `kokoro-parity --help` stays fast and a missing extra becomes a skip.
"""

__version__ = "0.1.0"
