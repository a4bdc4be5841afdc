"""The ranks' entry point of multi-process training (``accelerate launch ... -m tasks.launch REQUEST``): every rank
runs the stage's plain function (``run_sft`` / ``run_grpo``); rank 0 alone logs to the stage's MLflow run and
writes the result that the stage task reads back. The launch itself (command, request and result files, a dead
rank's error) is ``tasks/training/launch.py``; this module sits beside the stages because it calls them.
Must not import: Prefect (the ranks run no flow).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.grpo import run_grpo
from tasks.models.vllm_logs import route_vllm_logging
from tasks.sft import run_sft
from tasks.tracking import StageRun
from tasks.training import CheckpointMirror, LaunchRequest, MlflowTrainerCallback, rank_done_file, store_for


def rank_main(request_path: Path) -> None:
    """One rank: run the stage's plain function; rank 0 logs to MLflow and writes the result."""
    rank, node = int(os.environ.get("RANK", "0")), int(os.environ.get("GRPOFLOW_NODE_RANK", "0"))
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank {rank}] %(message)s")
    route_vllm_logging(console_prefix=f"[rank {rank}] ")  # rank 0's vLLM lines reach the console under --verbose
    # Every rank says where it runs, in its node's log (a rank other than 0 logs only warnings).
    where = f"node {node}: RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={os.environ.get('WORLD_SIZE', '1')}"
    sys.stdout.write(f"[rank {rank}] {where}\n")  # one write: the ranks share the launcher's output
    sys.stdout.flush()
    launch_dir = request_path.parent
    request = LaunchRequest(**json.loads(request_path.read_text()))
    try:
        config = PipelineConfig.model_validate(request.config)
        stage_dir = Path(request.stage_dir)
        stage = StageRun(request.tracking_uri, request.stage_run_id, request.stage, stage_dir)
        callbacks = [MlflowTrainerCallback(stage)] if rank == 0 else []
        if local_rank == 0 and request.checkpoint_store:  # each node copies its own part of every checkpoint
            world = int(os.environ.get("WORLD_SIZE", "1"))
            first = rank - local_rank  # the node's processes are consecutive ranks
            states = [f"rng_state_{i}.pth" for i in range(first, first + local_world)] if world > 1 else []
            store = store_for(request.checkpoint_store)
            callbacks.append(CheckpointMirror(store, config.orchestration.keep_checkpoints, states))
        if request.stage == "sft":
            result = run_sft(config, Path(request.train_path), Path(request.base_model_dir), stage_dir, callbacks)
        else:
            result = run_grpo(
                config,
                Path(request.train_path),
                Path(request.base_model_dir),
                Path(request.sft_adapter_dir) if request.sft_adapter_dir else None,
                stage_dir,
                callbacks,
                set(request.keep_ids) if request.keep_ids is not None else None,
                completion_sink=(
                    (lambda step, table: stage.log_table(table, f"completions/step_{step:05d}.json"))
                    if rank == 0
                    else None
                ),
            )
    except BaseException as exc:
        report = {
            "rank": rank,
            "node": node,
            "type": type(exc).__name__,
            "module": type(exc).__module__,
            "message": str(exc)[:2000],
            "time": time.time(),
        }
        (launch_dir / f"rank-{rank}.error.json").write_text(json.dumps(report))
        leave_process_group(finished=False)
        raise
    allreduce = adapter_allreduce(result.adapter_dir if rank == 0 else None)
    if rank == 0:
        payload = {
            **allreduce,
            "adapter_dir": str(result.adapter_dir),
            "steps": result.steps,
            "seconds": result.seconds,
            "history": result.history,
            "stop": result.stop,
            "generated_by": result.generated_by,
            "selection": result.selection,
            "holdout_seconds": result.holdout_seconds,
        }
        (launch_dir / "result.json").write_text(json.dumps(payload))
    leave_process_group(finished=True)
    rank_done_file(launch_dir, rank).touch()  # an abort at exit from here on loses nothing: the agent says so


def adapter_allreduce(adapter_dir: Path | None, repeats: int = 10) -> dict[str, float]:
    """What one all-reduce of the adapter's gradients costs on this group: ``allreduce_ms`` and its size,
    ``allreduce_bytes`` (the adapter's trainable values, fp32, as DDP reduces them each step), measured once the
    training is done; rank 0 passes its adapter, the others None. Empty on one process.

    >>> adapter_allreduce(None)  # no process group
    {}
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    count = torch.zeros(1, dtype=torch.long)
    if adapter_dir is not None:
        from safetensors import safe_open

        with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as weights:
            names = weights.keys()  # a safetensors file, not a dict
            count[0] = sum(math.prod(weights.get_slice(name).get_shape()) for name in names)
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if dist.get_backend() == "nccl" else "cpu"
    count = count.to(device)
    dist.broadcast(count, 0)
    gradients = torch.ones(int(count.item()), device=device)
    dist.all_reduce(gradients)  # the first pays for setting up the buffers
    dist.barrier()
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(gradients)
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed_ms = (time.perf_counter() - started) / repeats * 1000
    return {"allreduce_ms": round(elapsed_ms, 3), "allreduce_bytes": gradients.numel() * gradients.element_size()}


def leave_process_group(finished: bool) -> None:
    """End this rank's part in the process group before the interpreter exits. Left to interpreter shutdown,
    gloo's threads are destroyed still joinable and the process aborts ("terminate called without an active
    exception", SIGABRT) after its work is done. A finished rank first waits at a barrier until every rank is past
    its last collective and rank 0 has written the result; a failing rank does not wait for peers that may be gone.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
