"""What a version records for serving and how the checks read it."""

from __future__ import annotations

from pathlib import Path

from tasks.serving import SmokeRecord, adapter_digest, read_smoke_record, smoke_verdict, write_smoke_record

RECORD = SmokeRecord(
    [[{"role": "user", "content": "2+2?"}]] * 2,
    ["four", "The sum is 4."],
    "transformers",
    "bf16",
    8,
    None,
    "cpu:amx_bf16; torch 2.13.0+cpu",
)


def test_the_digest_changes_with_any_byte_of_the_config_or_weights(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "adapter_model.safetensors").write_bytes(bytes(range(256)))
    first = adapter_digest(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(bytes(range(255)) + b"\x00")
    second = adapter_digest(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    assert len({first, second, adapter_digest(tmp_path)}) == 3


def test_identity_is_asked_only_on_the_recording_engine_precision_and_device(tmp_path: Path) -> None:
    write_smoke_record(tmp_path, RECORD)
    record = read_smoke_record(tmp_path)
    assert record == RECORD and read_smoke_record(tmp_path / "elsewhere") is None
    near = ["four", "The sum is 5."]  # one character off at the end of the second answer
    here = ("transformers", "bf16", 0.5, RECORD.device)
    assert smoke_verdict(record, list(RECORD.answers), *here)[0]
    assert not smoke_verdict(record, near, *here)[0]
    for engine, precision, device in (
        ("vllm", "bf16", RECORD.device),
        ("transformers", "fp32", RECORD.device),
        ("transformers", "bf16", "cuda:NVIDIA H100 80GB HBM3; torch 2.13.0+cu128"),
    ):
        passed, said = smoke_verdict(record, near, engine, precision, 0.5, device)
        assert passed and "agree 0.92" in said, said  # (1 + 11/13) / 2
        assert not smoke_verdict(record, ["x", "y"], engine, precision, 0.5, device)[0]
