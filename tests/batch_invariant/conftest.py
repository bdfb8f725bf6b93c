import pytest
import torch

from tests.engine.conftest import _reuse_loaded_weights, default_model  # noqa: F401


@pytest.fixture(scope="session")
def smollm2_shaped(tmp_path_factory) -> str:
    """SmolLM2-135M's layer shapes (hidden 576, 9/3 heads, FFN 1536, tied head) with 2 layers
    instead of 30 and 20480 token ids instead of 49152 (the experiment's prompts use ids below
    20000), random weights: batch invariance is a property of the kernels at these sizes, and
    the invariant head over the full vocabulary was most of the test's time."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=20480, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("smollm2_shaped")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)
