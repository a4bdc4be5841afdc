"""Checkpoint retention: one setting (``orchestration.keep_checkpoints``) for the trainer's own folder and the
mirror."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.config import PipelineConfig
from tasks.training import CheckpointMirror, common_trainer_args, restore_newest, store_for


def _checkpoint(out: Path, step: int) -> None:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")


@pytest.mark.parametrize("keep", [1, 3])
def test_the_trainer_and_the_mirror_keep_the_same_number(keep: int, tmp_path: Path) -> None:
    config = PipelineConfig.model_validate({"orchestration": {"keep_checkpoints": keep}})
    assert common_trainer_args(config, tmp_path / "out", checkpoint_steps=1)["save_total_limit"] == keep

    where = {"remote_checkpoints": str(tmp_path / "mirror"), "tracking_uri": "", "parent_run_id": "", "run_id": "r"}
    store = store_for(where)
    mirror = CheckpointMirror(store, config.orchestration.keep_checkpoints)
    for step in range(1, 6):
        _checkpoint(tmp_path / "out", step)
        state = SimpleNamespace(global_step=step, is_world_process_zero=True, is_local_process_zero=True)
        mirror.on_save(SimpleNamespace(output_dir=str(tmp_path / "out")), state, None)
    assert store.complete() == [f"checkpoint-{step}" for step in range(5, 5 - keep, -1)]


def test_the_mirror_keeps_the_best_checkpoint_and_a_restore_brings_it_back(tmp_path: Path) -> None:
    """``grpo.select: best``: the checkpoint the trainer names best stays in the mirror past the newest ``keep``,
    and a worker that restores the newest also gets the best (its adapter is handed on at the end)."""
    import json

    from tasks.training import restore_newest

    store = store_for(
        {"remote_checkpoints": str(tmp_path / "mirror"), "tracking_uri": "", "parent_run_id": "", "run_id": "r"}
    )
    mirror = CheckpointMirror(store, keep=2)
    out = tmp_path / "out"
    for step in range(1, 6):
        _checkpoint(out, step)
        best = str(out / "checkpoint-2") if step >= 2 else None
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": best}))
        state = SimpleNamespace(
            global_step=step, is_world_process_zero=True, is_local_process_zero=True, best_model_checkpoint=best
        )
        mirror.on_save(SimpleNamespace(output_dir=str(out)), state, None)
    assert store.complete() == ["checkpoint-5", "checkpoint-4", "checkpoint-2"]
    fresh = tmp_path / "fresh"
    assert restore_newest(store, fresh) == "checkpoint-5"
    assert sorted(p.name for p in fresh.iterdir()) == ["checkpoint-2", "checkpoint-5"]


def test_the_default_keeps_two() -> None:
    assert PipelineConfig().orchestration.keep_checkpoints == 2


def test_a_checkpoint_of_several_nodes_is_complete_once_every_node_put_its_part(tmp_path: Path) -> None:
    from tasks.training.remote_checkpoints import FolderStore, restore_newest

    root = tmp_path / "store"
    parts = {}
    for node in (0, 1):
        part = tmp_path / f"node-{node}" / "checkpoint-4"
        part.mkdir(parents=True)
        (part / f"rng_state_{node}.pth").write_text(str(node))
        if node == 0:
            (part / "adapter_model.safetensors").write_text("weights")
        parts[node] = part
    FolderStore(root, nodes=2, node=0).put(parts[0])
    assert FolderStore(root, nodes=2, node=1).complete() == []  # node 1's random state is not there yet
    FolderStore(root, nodes=2, node=1).put(parts[1])
    assert FolderStore(root, nodes=2, node=1).complete() == ["checkpoint-4"]
    restored = tmp_path / "resumed" / "checkpoints"
    assert restore_newest(FolderStore(root, nodes=2, node=1), restored) == "checkpoint-4"
    assert sorted(p.name for p in (restored / "checkpoint-4").iterdir()) == [
        "adapter_model.safetensors",
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]  # every node restores every process's random state
    FolderStore(root, nodes=2).delete("checkpoint-4")
    assert FolderStore(root, nodes=2).complete() == [] and not (root / "checkpoint-4").exists()


def test_a_node_whose_base_model_differs_stops_naming_itself(tmp_path: Path) -> None:
    from tasks.training.nodes.agent import NodeInputError, base_model_for

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    request = {"model": {"source": str(folder), "revision": None, "digest": "0" * 16, "shipped": False}}
    with pytest.raises(NodeInputError, match=r"node 1: the base model .* resolves here to other bytes"):
        base_model_for(request, None, tmp_path / "inputs", node=1)
    from tasks.training.nodes import model_digest

    request["model"]["digest"] = model_digest(folder)
    assert base_model_for(request, None, tmp_path / "inputs", node=1) == folder


def test_a_checkpoint_missing_a_processs_random_state_is_never_marked_complete(tmp_path: Path) -> None:
    from tasks.training.remote_checkpoints import FolderStore

    store = FolderStore(tmp_path / "store", nodes=2, node=1)
    mirror = CheckpointMirror(store, keep=2, random_states=["rng_state_2.pth", "rng_state_3.pth"], wait_s=0.2)
    out = tmp_path / "out"
    state = SimpleNamespace(global_step=4, is_world_process_zero=False, is_local_process_zero=True)
    _checkpoint(out, 4)
    (out / "checkpoint-4" / "rng_state_2.pth").write_text("2")  # rank 3's file never came
    mirror.on_save(SimpleNamespace(output_dir=str(out)), state, None)
    assert not (tmp_path / "store" / "checkpoint-4.node-1.complete").exists()
    (out / "checkpoint-4" / "rng_state_3.pth").write_text("3")
    mirror.on_save(SimpleNamespace(output_dir=str(out)), state, None)
    assert (tmp_path / "store" / "checkpoint-4.node-1.complete").exists()


def test_a_resume_discards_newer_local_checkpoints_and_takes_the_stores_copy(tmp_path: Path) -> None:
    from tasks.training.remote_checkpoints import FolderStore, restore_newest

    store = FolderStore(tmp_path / "store")
    _checkpoint(tmp_path / "mirrored", 4)
    (tmp_path / "mirrored" / "checkpoint-4" / "adapter_model.safetensors").write_text("the store's")
    store.put(tmp_path / "mirrored" / "checkpoint-4")
    local = tmp_path / "node"  # a persistent work folder: its own checkpoint-6, and a stale copy of checkpoint-4
    for step, text in ((4, "stale"), (6, "never complete everywhere")):
        _checkpoint(local, step)
        (local / f"checkpoint-{step}" / "adapter_model.safetensors").write_text(text)
    assert restore_newest(store, local) == "checkpoint-4"
    assert sorted(p.name for p in local.iterdir()) == ["checkpoint-4"]
    assert (local / "checkpoint-4" / "adapter_model.safetensors").read_text() == "the store's"


def test_a_resumed_pipeline_finds_the_killed_attempts_checkpoints_in_its_parent_run(tmp_path: Path) -> None:
    """`grpoflow run --resume` opens a new parent run; a remote GRPO deployment and the nodes stage must still
    restore from the killed attempt's MLflow store (the newest attempt holding a complete checkpoint)."""
    from tasks.tracking import client_for
    from tasks.tracking.runs import RUN_ID_TAG
    from tasks.training import resume_source

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    experiment = client.create_experiment("resume", artifact_location=(tmp_path / "artifacts").as_uri())
    killed, other, resumed = (
        client.create_run(experiment, start_time=1000 * t, tags={RUN_ID_TAG: run}).info.run_id
        for t, run in ((1, "r1"), (2, "r2"), (3, "r1"))
    )
    client.create_run(experiment, start_time=4000, tags={RUN_ID_TAG: "r1", "mlflow.parentRunId": resumed})
    where = {"remote_checkpoints": None, "tracking_uri": uri, "parent_run_id": resumed, "run_id": "r1"}
    assert resume_source(client, experiment, "r1", where) == where  # nothing saved yet anywhere

    _checkpoint(tmp_path / "saved", 4)
    for run in (killed, other):
        store_for({**where, "parent_run_id": run}).put(tmp_path / "saved" / "checkpoint-4")
    source = resume_source(client, experiment, "r1", where)
    assert source["parent_run_id"] == killed  # not another pipeline run's, not the new attempt's empty one
    assert restore_newest(store_for(source), tmp_path / "resumed") == "checkpoint-4"
    assert (tmp_path / "resumed" / "checkpoint-4" / "trainer_state.json").is_file()
