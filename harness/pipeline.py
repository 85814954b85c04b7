"""One path for every kind of item, from either face: run it, and with `--bisect` localize it.

A backend step (`runner.Item`), a user's artifact (`artifacts.ArtifactItem`), a rewrite
(`rewrite.RewriteItem`) and a port or
whole-model file (`port.chain.PortItem`) each know how they run (`run`), whether a record of theirs
can be localized (`localizable`) and how (`localize`). The faces build items and call `check`:
neither tests what kind an item is, so `pytest --bisect` and `kokoro-parity run --bisect` localize
the same items the same way.
"""
from __future__ import annotations

from typing import Callable, Protocol

from .artifacts import artifact_items
from .options import Localize, RunConfig
from .port.chain import port_items
from .rewrite import rewrite_items


class CheckedItem(Protocol):
    id: str

    def run(self, session): ...

    def localizable(self, record, how: Localize) -> bool: ...

    def localize(self, session, record, how: Localize, log: Callable[[str], None]) -> None: ...


def check(session, item: CheckedItem, localize: Localize | None = None, log: Callable[[str], None] = print):
    """Run one item (its record written) and, when asked and it applies, localize it (the record
    rewritten with the localization). Returns the record."""
    record = item.run(session)
    if localize is not None and item.localizable(record, localize):
        item.localize(session, record, localize, log)
    return record


def items(session, config: RunConfig, backends: list[str]) -> list:
    """The items a run asks for: every (case, step, backend, mode) of the chosen backends, then the
    user's artifacts (`--artifact STEP=PATH`), whole-model files (`--artifact e2e=PATH`) and port
    files (`--port`), then the rewrites (`--rewrite`). With artifacts, ports or rewrites and no
    `--backend`, only the user's items run."""
    specs = [s for s in config.artifacts if not s.startswith("e2e=")]
    ports = [s for s in config.artifacts if s.startswith("e2e=")] + list(config.ports)
    only_users = (specs or ports or config.rewrites) and not config.backends
    found = [] if only_users else session.items(backends, list(config.steps) if config.steps else None,
                                                config.modes)
    runtimes = config.artifact_runtimes  # `--artifact-runtime`: what runs each artifact and whole-model file
    return (found + artifact_items(session, specs, config.modes, runtimes)
            + port_items(session, ports, config.modes, runtimes)
            + rewrite_items(session, list(config.rewrites)))
