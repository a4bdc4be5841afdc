"""The ``grpoflow`` command: one module per command group, registered here in one list, and the error boundary
(``boundary.main``, the console script's entry point). A command parses, calls a flow or a stage function, and
prints; it holds no stage logic.
Must not import: torch, transformers, math-verify or a stage at import (``grpoflow --help`` stays light: a test
checks); each command imports what it needs inside its body.
"""

from __future__ import annotations

from flows.cli import models, registry, rollouts, run, servers
from flows.cli.boundary import main
from flows.cli.common import app

# The commands in the order ``grpoflow --help`` lists them.
COMMANDS = (
    run.run,
    run.validate,
    run.check,
    run.probe,
    registry.rollback,
    registry.versions,
    registry.history,
    registry.watch,
    registry.pin,
    registry.unpin,
    models.generate,
    models.evaluate,
    models.export,
    rollouts.rollouts,
    rollouts.rescore,
    registry.migrate,
    servers.up,
    servers.deploy,
    servers.vllm_serve,
    servers.serve,
    servers.node_agent,
)
for _command in COMMANDS:
    app.command()(_command)

__all__ = ["COMMANDS", "app", "main"]
