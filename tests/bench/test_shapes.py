"""bench.shapes: the random-weight GGUF of a shape has that shape, the default model's
tokenizer, and loads and generates in Duplex."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from duplex.bench import shapes
from duplex.engine.config import default_model_path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "tiny.gguf"
    return shapes.write_gguf(shapes.SHAPES["tiny"], path, default_model_path())


def test_the_file_has_the_shape_and_the_tokenizer(tiny_gguf):
    from duplex.engine.models.gguf_reader import read_gguf

    # gguf's own reader on the written file; Duplex's (faster) on the source
    reader, source = gguf.GGUFReader(tiny_gguf), read_gguf(default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"])
    tensors = {t.name: t for t in reader.tensors}
    expected = shapes.tensor_shapes(shapes.SHAPES["tiny"], vocab)
    assert list(tensors) == [name for name, _ in expected]
    for name, dims in expected:
        assert tuple(int(d) for d in reversed(tensors[name].shape)) == dims  # GGUF: ne order
    weights = np.asarray(tensors["blk.0.attn_q.weight"].data, dtype=np.float32)
    assert 0.015 < weights.std() < 0.025 and tensors["blk.0.attn_q.weight"].tensor_type == \
        gguf.GGMLQuantizationType.F16
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert reader.fields[key].contents() == source.fields[key]
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2


def test_duplex_loads_and_generates_from_it(tiny_gguf):
    from duplex import LLM, SamplingParams

    llm = LLM(str(tiny_gguf), num_threads=1, progress=False)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0,
                                                  ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_real_shapes_have_their_sizes():
    vocab = 49152
    assert 1.0e9 < shapes.num_params(shapes.SHAPES["1b"], vocab) < 1.15e9
    assert 2.9e9 < shapes.num_params(shapes.SHAPES["3b"], vocab) < 3.1e9  # 3.2 B with 128k rows
    assert 7.3e9 < shapes.num_params(shapes.SHAPES["8b"], vocab) < 7.8e9
