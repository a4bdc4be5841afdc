"""What SFT and GRPO share below their stage modules: trainer arguments, callbacks and checkpoints, the
multi-process launch (the ranks' entry point is ``tasks/launch.py``), the learning-signal guards, and checkpoints
that outlive a worker. Must not import: Prefect, a stage.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "CompletionSampleLogger": "callbacks",
    "HoldoutEvaluation": "holdout",
    "HoldoutEvaluationMixin": "holdout",
    "HoldoutPatience": "holdout",
    "Selection": "holdout",
    "final_holdout_rows": "holdout",
    "holdout_trainer_args": "holdout",
    "read_selection": "holdout",
    "select_adapter": "holdout",
    "slice_for": "holdout",
    "write_selection": "holdout",
    "LEDGER_DIR": "ledger",
    "LEDGER_SCHEMA_VERSION": "ledger",
    "LedgerCallback": "ledger",
    "LedgerRecorder": "ledger",
    "read_ledger": "ledger",
    "completion_columns": "ledger",
    "conversation": "ledger",
    "conversation_text": "ledger",
    "reward_values": "ledger",
    "sample_rows": "ledger",
    "write_part": "ledger",
    "NoneShareGuard": "callbacks",
    "RewardNoneLimitExceeded": "callbacks",
    "SamplerAgreementGuard": "callbacks",
    "SamplerMismatch": "callbacks",
    "LaunchRequest": "launch",
    "train_on_processes": "launch",
    "RetirementPool": "learning_signal",
    "SIGNAL_STATE_FILE": "learning_signal",
    "SignalStateSaver": "learning_signal",
    "SignalStop": "learning_signal",
    "choose_groups": "learning_signal",
    "draws_needed": "learning_signal",
    "informative_groups": "learning_signal",
    "load_signal_state": "learning_signal",
    "solved_groups": "learning_signal",
    "ARTIFACT_DIR": "remote_checkpoints",
    "CheckpointMirror": "remote_checkpoints",
    "MlflowStore": "remote_checkpoints",
    "clear": "remote_checkpoints",
    "restore_newest": "remote_checkpoints",
    "store_for": "remote_checkpoints",
    "CorruptCheckpoint": "trainer",
    "MetricsHistory": "trainer",
    "MlflowTrainerCallback": "trainer",
    "TrainResult": "trainer",
    "check_checkpoint": "trainer",
    "checkpoint_history": "trainer",
    "checkpoint_step": "trainer",
    "common_trainer_args": "trainer",
    "logger": "trainer",
    "lora_config": "trainer",
    "replay_history": "trainer",
    "resumable_checkpoint": "trainer",
    "train_and_save": "trainer",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
