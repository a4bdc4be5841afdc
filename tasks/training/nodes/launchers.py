"""What starts the node agents of a multi-node stage, each only starting N agents: ``local`` (N agent processes on
this host, each in a filesystem and PID namespace of its own where bubblewrap is installed: the tested path and a
one-host harness), ``manual`` (prints each node's command for a person or another tool to run), and Slurm and
Kubeflow in their own modules. A job says whether it still runs and can be cancelled; the nodes' results come back
through MLflow, not through the launcher.

Must not import: Prefect, MLflow (the stage waits on MLflow; a launcher only starts and stops).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from tasks.training.threads import rank_threads

logger = logging.getLogger(__name__)

# The sandbox's user-id claims are the host's (user ids are), so every node on one host shares this folder.
SANDBOX_UID_CLAIMS = "/tmp/grpoflow-sandbox-uids"
NODE_HOME = "/tmp/grpoflow-node"  # inside a node's own /tmp: its work folder, grpoflow cache and HF cache


class NodeJob(Protocol):
    description: str

    def start(self) -> None: ...
    def state(self) -> str: ...  # "running" | "ended" | "unknown" (the launcher cannot tell: wait on MLflow)
    def ends(self) -> dict[int, str]: ...  # how each node's process ended, where the launcher knows
    def cancel(self) -> None: ...


def agent_command(tracking_uri: str, stage_run_id: str, manifest: str, node: int | None = None) -> list[str]:
    """The node agent's command line (the node rank left to Slurm's or Kubeflow's settings when ``None``).
    ``manifest`` is the digest of the stage's sealed manifest: the agent trusts no file its run holds without it.

    >>> " ".join(agent_command("http://mlflow:5000", "abc", "9f2c", 1)[1:])
    '-m tasks.training.nodes.agent --tracking-uri http://mlflow:5000 --stage-run abc --manifest 9f2c --node-rank 1'
    """
    command = [sys.executable, "-m", "tasks.training.nodes.agent", "--tracking-uri", tracking_uri]
    command += ["--stage-run", stage_run_id, "--manifest", manifest]
    return command + (["--node-rank", str(node)] if node is not None else [])


def kept_paths(private: tuple[str, ...] = ("/tmp", "/dev/shm")) -> list[str]:
    """What a node must still see under the folders it gets its own copy of: the code, the virtual environment and
    the interpreter, and every import path (a clone under ``/tmp`` is common: CI's is). Outermost first, nested
    ones left out (they come with their parent).

    >>> import sys; all(not path.startswith(("/tmp/", "/dev/shm/")) or Path(path).exists() for path in kept_paths())
    True
    """
    candidates = {Path(__file__).resolve().parents[3], Path(sys.prefix), Path(sys.base_prefix)}
    candidates |= {Path(sys.executable).resolve().parent, *(Path(entry) for entry in sys.path if entry)}
    under = [
        path.resolve()
        for path in candidates
        if path.exists() and any(str(path.resolve()).startswith(f"{root}/") for root in private)
    ]
    kept: list[str] = []
    for path in sorted({str(p) for p in under}, key=len):
        if not any(path == k or path.startswith(f"{k}/") for k in kept):
            kept.append(path)
    return kept


def bubblewrap_prefix(bwrap: str = "bwrap", chdir: str = "/tmp") -> list[str]:
    """A node of its own on this host: the host read-only, a private ``/tmp`` and ``/dev/shm`` (node 1 cannot see
    node 0's files; the code and venv, wherever they are, stay visible read-only), its own PID namespace (the node
    ends whole: killing its first process ends everything under it), and the host's network, so the nodes meet on
    loopback.

    >>> "--unshare-pid" in bubblewrap_prefix() and "--tmpfs" in bubblewrap_prefix()
    True
    """
    again = [arg for path in kept_paths() for arg in ("--ro-bind", path, path)]
    return [
        bwrap,
        *("--ro-bind", "/", "/", "--dev-bind", "/dev", "/dev", "--proc", "/proc"),
        *("--tmpfs", "/tmp", "--tmpfs", "/dev/shm", *again),
        *("--bind", SANDBOX_UID_CLAIMS, SANDBOX_UID_CLAIMS),
        *("--unshare-pid", "--die-with-parent", "--chdir", chdir),
    ]


def node_environment(home: str) -> dict[str, str]:
    """What a node writes goes under ``home`` (its own): temp files, grpoflow's model cache, the HF cache.

    >>> node_environment("/tmp/n")["GRPOFLOW_CACHE"]
    '/tmp/n/cache'
    """
    return {
        "TMPDIR": f"{home}/tmp",
        "GRPOFLOW_CACHE": f"{home}/cache",
        "HF_HOME": f"{home}/hf",
        "MPLCONFIGDIR": f"{home}/mpl",
    }


class LocalNodes:
    """N node agents on this host. Each node's agent log is ``<launch_dir>/node-K.agent.log``; ``nodes.json`` holds
    each node's process group (``kill_node`` ends one whole, as a machine that dies would)."""

    def __init__(
        self,
        commands: list[list[str]],
        launch_dir: Path,
        isolate: bool | None = None,
        processes_per_node: int = 1,
        shared: tuple[Path, ...] = (),
        network_namespaces: tuple[str, ...] = (),
    ) -> None:
        self.commands, self.launch_dir = commands, launch_dir
        self.shared = shared  # folders every node writes and reads, as on a cluster's shared volume
        self.network_namespaces = network_namespaces  # node K in the K-th (ip netns): a network of its own
        # This process's threads shared among every rank of every node (torch's threads spin while they wait).
        self.threads = str(rank_threads(len(commands) * processes_per_node))
        self.isolated = shutil.which("bwrap") is not None if isolate is None else isolate
        self.processes: list[subprocess.Popen[str]] = []
        self.readers: list[threading.Thread] = []
        where = "each in its own filesystem and PID namespace" if self.isolated else "sharing this host's files"
        where += f", network namespaces {', '.join(network_namespaces)}" if network_namespaces else ""
        self.description = f"{len(commands)} local nodes ({where}; logs {launch_dir}/node-K.agent.log)"

    def start(self) -> None:
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        for folder in self.shared:
            folder.mkdir(parents=True, exist_ok=True)
        if self.isolated:
            Path(SANDBOX_UID_CLAIMS).mkdir(mode=0o700, parents=True, exist_ok=True)
        else:
            logger.warning("bubblewrap not found: the local nodes share this host's filesystem")
        for node, command in enumerate(self.commands):
            # Distinct local addresses (all of 127/8 is loopback): torch's rendezvous tells nodes apart by
            # address and process id, and two PID namespaces give both agents the same process id. In a network
            # namespace of its own, the agent takes its address from the route to node 0.
            if not self.network_namespaces:
                command = [*command, "--local-addr", f"127.0.0.{node + 1}"]
            home = NODE_HOME if self.isolated else str(self.launch_dir / f"node-{node}")
            setup = f"mkdir -p {home}/tmp && exec " + shlex.join([*command, "--workdir", f"{home}/work"])
            binds = [arg for folder in self.shared for arg in ("--bind", str(folder), str(folder))]
            wrapped = [*(bubblewrap_prefix() + binds if self.isolated else []), "/bin/sh", "-c", setup]
            if self.network_namespaces:
                wrapped = ["ip", "netns", "exec", self.network_namespaces[node], *wrapped]
            process = subprocess.Popen(
                wrapped,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env={**os.environ, **node_environment(home), "OMP_NUM_THREADS": self.threads},
                start_new_session=True,
            )
            self.processes.append(process)
            reader = threading.Thread(target=self._forward, args=(node, process), daemon=True)
            reader.start()
            self.readers.append(reader)
        nodes = {node: {"pid": p.pid, "process_group": p.pid} for node, p in enumerate(self.processes)}
        (self.launch_dir / "nodes.json").write_text(json.dumps(nodes))

    def _forward(self, node: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        with (self.launch_dir / f"node-{node}.agent.log").open("w") as log:
            for line in process.stdout:
                log.write(line)
                log.flush()
                if line.startswith("[rank 0] "):
                    logger.info("%s", line.rstrip()[len("[rank 0] ") :])

    def state(self) -> str:
        return "ended" if all(p.poll() is not None for p in self.processes) else "running"

    def ends(self) -> dict[int, str]:
        return {node: describe_exit(p.poll()) for node, p in enumerate(self.processes) if p.poll() is not None}

    def kill_node(self, node: int) -> None:
        """End node ``node`` whole, at once (SIGKILL to its process group, and so its PID namespace)."""
        kill_group(self.processes[node].pid, signal.SIGKILL)

    def cancel(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                kill_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(process.pid, signal.SIGKILL)
                process.wait()
        for reader in self.readers:
            reader.join(timeout=5)


def kill_group(pid: int, sig: int) -> None:
    """Signal the process group ``pid`` leads (a node's agent and everything it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def describe_exit(returncode: int | None) -> str:
    """A process's end in words.

    >>> describe_exit(0), describe_exit(-9), describe_exit(None)
    ('exit 0', 'killed by signal 9 (SIGKILL)', 'still running')
    """
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    return f"exit {returncode}"


class ManualNodes:
    """Prints each node's command (and writes them to ``<launch_dir>/commands.sh``); a person or another tool
    runs them, one per machine, and the stage waits for their reports in MLflow."""

    def __init__(self, commands: list[list[str]], launch_dir: Path, env: tuple[str, ...] = ()) -> None:
        self.commands, self.launch_dir, self.env = commands, launch_dir, env
        self.description = f"{len(commands)} nodes started by hand ({launch_dir}/commands.sh)"

    def start(self) -> None:
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        # The installed command, not this machine's interpreter path: each machine runs its own install.
        commands = [["grpoflow", "node-agent", *command[3:]] for command in self.commands]
        lines = [f"# node {node}\n{shlex.join(command)}" for node, command in enumerate(commands)]
        (self.launch_dir / "commands.sh").write_text("#!/bin/sh\n" + "\n".join(lines) + "\n")
        logger.warning("run each node's command on its machine (node 0 at orchestration.rendezvous_host):")
        if self.env:
            logger.warning("with these set in its environment (orchestration.env): %s", " ".join(self.env))
        for node, command in enumerate(commands):
            logger.warning("node %d: %s", node, shlex.join(command))

    def state(self) -> str:
        return "unknown"

    def ends(self) -> dict[int, str]:
        return {}

    def cancel(self) -> None:
        logger.warning("the nodes were started by hand: stop any still running yourself")
