"""A GGUF file read once per conversion: inside ``read_once`` the same file gives the same reader, with the fields
and tensors a reader of its own gives; outside it, ``gguf`` is as it was."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tasks.speedups.gguf_reading import read_once


def _small_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "</s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(4, 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_reader_per_file_inside_and_the_package_as_it_was_after(tmp_path: Path) -> None:
    path = _small_gguf(tmp_path / "small.gguf")
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    own = gguf.GGUFReader(path)
    with read_once():
        first, again = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is again  # the file parsed once
        assert list(first.fields) == list(own.fields)
        assert first.fields["tokenizer.ggml.tokens"].contents() == own.fields["tokenizer.ggml.tokens"].contents()
        assert [t.name for t in first.tensors] == [t.name for t in own.tensors]
        assert np.array_equal(first.tensors[0].data, own.tensors[0].data)
        maps = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2), gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert maps[0] is maps[1] and maps[0].get_name("model.embed_tokens") == "token_embd"
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not first
