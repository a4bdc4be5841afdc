"""Training on several nodes: the node agent (one per machine: fetches the launch request and inputs from the
stage's MLflow run, starts that machine's ``accelerate launch``, reports back through MLflow), the launchers that
start the agents (local, Slurm, a Kubeflow TrainJob, by hand), and the stage's side (send, wait, collect).
Must not import: Prefect (MLflow is the only thing between the nodes; the stage task wraps this).

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "NodeInputError": "exchange",
    "NodeInputTampered": "exchange",
    "run_agent": "agent",
    "StageArtifacts": "exchange",
    "model_digest": "exchange",
    "node_folder": "exchange",
    "LocalNodes": "launchers",
    "ManualNodes": "launchers",
    "agent_command": "launchers",
    "NodesNeedServer": "stage",
    "check_shared_store": "stage",
    "store_served_to_nodes": "stage",
    "train_on_nodes": "stage",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
