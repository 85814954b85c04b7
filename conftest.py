"""Repository-level pytest configuration.

The kokoro-parity plugin itself is registered by the installed package (entry point `pytest11`),
so `pytest --backend=xnnpack -k decoder` works from any directory of this checkout.
"""
