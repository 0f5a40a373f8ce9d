"""Tiny seeded checkpoints of model families transformers cannot build for mlx-lm as-is
(sliding windows, sinks, experts, recurrent layers), made through mlx-lm's own
`ModelArgs` and `save_model`, and quantized copies made by `mlx_lm.convert`."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import shutil
from pathlib import Path
from typing import Any

from unikern.errors import ConfigError
from unikern.testing.modelgen import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    _cached_dir,
    _special_token_ids,
    cache_root,
    cached_model,
    cached_tokenizer,
)

_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)

# mlx-lm configs (model_type + ModelArgs fields); vocab and token ids are filled in
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    # experts through mlx-lm's SwitchGLU; layer 0 dense
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                           moe_intermediate_size=64, rope_theta=1e6, tie_word_embeddings=False,
                           norm_topk_prob=True, **_ATTENTION),
    # sliding (window 48, shorter than most prompts) and full layers alternating
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                        query_pre_attn_scalar=16, sliding_window=48, sliding_window_pattern=2,
                        rope_theta=1e6, rope_local_base_freq=1e4, **_ATTENTION),
    # attention sinks, sliding + full layers, experts
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
                         num_local_experts=4, num_experts_per_tok=2, sliding_window=40, rope_theta=150000,
                         layer_types=["sliding_attention", "full_attention"] * 2, **_ATTENTION),
    # every layer sliding (window 40: whole blocks leave every window); mlx-lm's
    # mistral / ministral3 / gpt-oss code needs one full layer, step3p5's does not
    "tiny-step3p5-swa": dict(model_type="step3p5", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                             num_attention_heads=4, num_attention_groups=2, head_dim=16, sliding_window=40,
                             layer_types=["sliding_attention"] * 2, moe_layers_enum="1", moe_num_experts=4,
                             moe_top_k=2, moe_intermediate_size=64, share_expert_dim=64, rope_theta=1e4),
    # gated delta net layers + one attention layer in four, experts
    "tiny-qwen3-next": dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                            num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
                            mlp_only_layers=[], moe_intermediate_size=64, rope_theta=1e6,
                            partial_rotary_factor=0.5, full_attention_interval=4, **_ATTENTION),
    # Mamba 2 mixers, attention and MLP layers (pattern M*M-)
    "tiny-nemotron-h": dict(model_type="nemotron_h", hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False,
                            mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                            conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5,
                            use_bias=False, use_conv_bias=True, hybrid_override_pattern=list("M*M-")),
    # recurrent only: no attention layer at all
    "tiny-mamba2": dict(model_type="mamba2", num_heads=8, head_dim=16, hidden_size=64, intermediate_size=128, expand=2,
                        state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
                        use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
                        time_step_limit=[0.0, float("inf")], time_step_rank=4),
}

# parameters whose initial values the model's own constructor chooses (decay rates,
# time-step biases, skip gains): random noise there would make the recurrence explode
_KEEP_INIT = ("A_log", "dt_bias", ".D")


def cached_family_model(name: str, *, vocab_size: int = 1024, max_position_embeddings: int = 8192,
                        seed: int = 0, **fields: Any) -> Path:
    """The dir of a FAMILY_CONFIGS model (ModelArgs `fields` replaced), built on first use."""
    if name not in FAMILY_CONFIGS:
        raise ConfigError(f"unknown family preset {name!r}; choose one of {sorted(FAMILY_CONFIGS)}")
    config = {**FAMILY_CONFIGS[name], **fields, "vocab_size": vocab_size,
              "max_position_embeddings": max_position_embeddings}
    key = {"mlx_family": config, "seed": seed}
    return _cached_dir(cache_root(), key, lambda tmp: build_family_model(tmp, config, seed))


def build_family_model(out_dir: Path, config: dict[str, Any], seed: int) -> Path:
    """A seeded random checkpoint in mlx-lm's layout plus the shared test tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import save_config, save_model

    tok_dir = cached_tokenizer(config["vocab_size"])
    ids = _special_token_ids(tok_dir)
    config = {**config, "bos_token_id": ids[BOS_TOKEN], "eos_token_id": ids[EOS_TOKEN],
              "pad_token_id": ids[PAD_TOKEN]}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    named = sorted(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(named))
    params = [(name, _init(name, value, keys[i], config)) for i, (name, value) in enumerate(named)]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    out = Path(out_dir)
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / f, out / f)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = config["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True))
    return out


def _init(name: str, value: Any, key: Any, config: dict[str, Any]) -> Any:
    """Fan-in scaled noise, as modelgen's _init_weights: every weight matters and the
    logits are far from ties."""
    import mlx.core as mx

    if any(name.endswith(k) for k in _KEEP_INIT) or value.ndim == 0:
        return value
    noise = mx.random.normal(value.shape, key=key).astype(value.dtype)
    if value.ndim == 1 and "norm" in name and name.endswith(".weight"):
        # gemma's RMSNorm scales by 1 + weight; others by weight
        base = 0.0 if config["model_type"].startswith("gemma") else 1.0
        return base + 0.1 * noise
    if value.ndim == 1:  # biases, sinks
        return 0.1 * noise
    if "embed" in name or "lm_head" in name:
        return noise * (2.0 / math.sqrt(value.shape[-1]))
    fan_in = value.shape[-1] if "conv1d" not in name else value.shape[1]
    std = 1.0 / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
        std /= math.sqrt(2 * config.get("num_hidden_layers", 4))
    return noise * std


def cached_quantized(preset: str | dict[str, Any], bits: int, group_size: int = 32) -> Path:
    """A modelgen preset (or spec) converted by `mlx_lm.convert` with `-q` at `bits` bits
    in scale groups of `group_size`."""
    source = cached_model(preset)

    def convert(tmp: Path) -> None:
        from mlx_lm.convert import convert as mlx_convert

        target = tmp / "model"
        with contextlib.redirect_stdout(io.StringIO()):  # convert reports progress by print
            mlx_convert(str(source), str(target), quantize=True, q_bits=bits, q_group_size=group_size)
        for f in target.iterdir():
            shutil.move(str(f), tmp / f.name)
        target.rmdir()

    return _cached_dir(cache_root(), {"quantized": preset, "bits": bits, "group_size": group_size}, convert)
