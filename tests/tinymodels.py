"""Tiny random-weight models from configs, one per supported architecture family."""

import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)

# One config per supported architecture family (and the RoPE variants re-rotation must handle).
TINY_CONFIGS = {
    "llama": lambda v: LlamaConfig(vocab_size=v, **_SMALL),
    "llama3-scaled": lambda v: LlamaConfig(vocab_size=v, **_SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn": lambda v: LlamaConfig(vocab_size=v, **_SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64}),
    "linear": lambda v: LlamaConfig(vocab_size=v, **_SMALL, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen2": lambda v: Qwen2Config(vocab_size=v, **_SMALL),
    "mistral": lambda v: MistralConfig(vocab_size=v, **_SMALL, sliding_window=None),
    "phi3": lambda v: Phi3Config(vocab_size=v, **_SMALL, pad_token_id=0),
    "gemma": lambda v: GemmaConfig(vocab_size=v, **_SMALL, head_dim=16),
    "gpt-neox": lambda v: GPTNeoXConfig(vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.25}),
    "gpt2": lambda v: GPT2Config(vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                 initializer_range=0.2),
}
ROPE_ARCHS = [a for a in TINY_CONFIGS if a != "gpt2"]



def build_tiny(arch: str, tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    config = TINY_CONFIGS[arch](len(tokenizer))
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    return model


