"""Every model type mlx_lm ships, built tiny with random weights: the support sweep's zoo.

``python -m veloxpatch.eval.zoo`` prints which types each method serves compressed and which run unpatched, and why (the
README's supported-models table). One superset of small arguments fits most model types (``ModelArgs.from_dict`` ignores
keys a class does not take); ``OVERRIDES`` adds what a type needs beyond it. Vision-language wrappers get the same
arguments as their ``text_config``. ``UNBUILDABLE`` names the types that cannot be built here at all, with the reason.
"""

from __future__ import annotations

import pkgutil
from typing import Any

import mlx.core as mx
import mlx_lm.models

from .. import builder, cpu
from ..config import VeloxConfig
from ..integration import active_config, layer_io, patch, unpatch
from ..integration.float32 import upcast
from ..registry import METHODS
from .random_model import build

SMALL: dict[str, Any] = dict(
    hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, rms_norm_eps=1e-5, norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5,
    vocab_size=97, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
    attention_bias=False, mlp_bias=False, use_bias=False, rope_scaling=None, partial_rotary_factor=0.5,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, num_shared_experts=1, shared_expert_intermediate_size=32, norm_topk_prob=True,
    first_k_dense_replace=1, routed_scaling_factor=1.0, n_group=1, topk_group=1, decoder_sparse_step=1,
    mlp_only_layers=[],
    # multi-head latent attention
    kv_lora_rank=24, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
)

SLIDING = ["sliding_attention", "full_attention"]
MAMBA: dict[str, Any] = dict(state_size=8, ssm_state_size=8, conv_kernel=3, use_conv_bias=True, time_step_rank=4,
                             n_groups=1, time_step_limit=(0.01, 10.0))
LINEAR: dict[str, Any] = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                              linear_value_head_dim=8, linear_conv_kernel_dim=3)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
GEMMA4: dict[str, Any] = dict(num_hidden_layers=4, layer_types=SLIDING * 2, sliding_window=8, num_kv_shared_layers=2,
                              hidden_size_per_layer_input=8, vocab_size_per_layer_input=97, global_head_dim=16)
GRANITE = dict(logits_scaling=1.0, attention_multiplier=0.125, embedding_multiplier=1.0, residual_multiplier=1.0)
LFM2: dict[str, Any] = dict(conv_bias=False, conv_L_cache=3, block_dim=32, block_multiple_of=16,
                            block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, full_attn_idxs=[1])

OVERRIDES: dict[str, dict[str, Any]] = {
    "afm7": dict(hidden_dim=32, num_layers=3, num_kv_reuse_layers=1, num_heads=4, num_kv_heads=2),
    "afmoe": dict(layer_types=SLIDING, sliding_window=8),
    "apertus": dict(post_norm=False, qk_norm=True),
    "baichuan_m1": dict(sliding_window=8, sliding_window_layers=[0], conv_window=2, tie_word_embeddings=False),
    "bailing_hybrid": dict(layer_group_size=2, group_norm_size=1),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "cohere2": dict(sliding_window=8, sliding_window_pattern=2),
    "dbrx": dict(d_model=32, n_layers=2, n_heads=4,
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}),
    "deepseek_v2": dict(topk_method="greedy", rope_scaling={"factor": 1.0, "original_max_position_embeddings": 512}),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2),
    "exaone": dict(num_layers=2),
    "exaone4": dict(sliding_window=8, sliding_window_pattern="LG"),
    "exaone_moe": dict(sliding_window=8, layer_types=SLIDING, is_moe_layer=[False, True]),
    "gear": dict(layer_types=SLIDING, sliding_window=8),
    "gemma3": dict(sliding_window=8, sliding_window_pattern=2),
    "gemma3_text": dict(sliding_window=8, sliding_window_pattern=2),
    "gemma3n": dict(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=97, sliding_window=8,
                    rope_local_base_freq=10000.0, final_logit_softcapping=30.0,
                    layer_types=SLIDING * 2, activation_sparsity_pattern=[0.0] * 4,
                    hidden_size_per_layer_input=8, altup_num_inputs=2, altup_coef_clip=None,
                    altup_correct_scale=True, altup_active_idx=0, laurel_rank=4),
    "gemma4": GEMMA4,
    "gemma4_text": GEMMA4,
    "glm4_moe": dict(use_qk_norm=True),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=2, index_topk=8, topk_method="noaux_tc",
                        scoring_func="sigmoid", moe_layer_freq=1, rope_parameters=ROPE),
    "gpt2": dict(n_ctx=512, n_embd=32, n_head=4, n_layer=2, n_positions=512),
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_inner=64, n_head=4, n_positions=512),
    "gpt_neox": dict(rotary_emb_base=10000.0, rotary_pct=0.5),
    "gptj": dict(n_embd=32, n_head=4, n_layer=2, n_positions=512, rotary_dim=4),
    "granite": GRANITE,
    "granitemoe": GRANITE,
    "granitemoehybrid": dict(GRANITE, layer_types=["mamba", "attention"], shared_intermediate_size=32,
                             mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=8,
                             mamba_d_conv=3, mamba_n_groups=1, mamba_conv_bias=True),
    "hunyuan": dict(moe_topk=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=True,
                    cla_share_factor=2, rope_scaling={"alpha": 1.0, "type": "dynamic", "factor": 1.0}),
    "jamba": dict(num_hidden_layers=2, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2, mamba_d_conv=3, mamba_d_state=8, mamba_expand=2),
    "kimi_k3": dict(linear_attn_config={"num_heads": 4, "head_dim": 8, "kda_layers": [1], "short_conv_kernel_size": 3},
                    num_experts_per_token=2),
    "kimi_linear": dict(linear_attn_config={"num_heads": 4, "head_dim": 8, "kda_layers": [1]}, model_max_length=512),
    "lfm2": LFM2,
    "lfm2-vl": dict(LFM2, text_config={"model_type": "lfm2"}),
    "lfm2_moe": dict(use_expert_bias=False, num_dense_layers=1, conv_bias=False, conv_L_cache=3, full_attn_idxs=[1]),
    "lille-130m": dict(block_size=512, n_embd=64, n_head=4, n_kv_heads=2, n_layer=2),
    "llama4": dict(attention_chunk_size=8, interleave_moe_layer_step=2, intermediate_size_mlp=64, use_qk_norm=True,
                   num_experts_per_tok=1, num_hidden_layers=4),
    "llama4_text": dict(intermediate_size_mlp=64, no_rope_layers=[1, 0], use_qk_norm=True),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=64, moe_topk=2,
                          expert_ffn_hidden_size=32, zero_expert_num=2, num_layers=2, mla_scale_q_lora=True,
                          mla_scale_kv_lora=True),
    "longcat_flash_ngram": dict(ffn_hidden_size=64, moe_topk=2, expert_ffn_hidden_size=32, zero_expert_num=2,
                                num_layers=2, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mamba": dict(MAMBA),
    "mamba2": dict(MAMBA, num_heads=4, head_dim=16),
    "mellum": dict(sliding_window=8, layer_types=SLIDING,
                   rope_parameters={"full_attention": ROPE, "sliding_attention": ROPE}),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[1, 0], moe_layer_freq=[0, 1], add_swa_attention_sink_bias=True,
                          add_full_attention_sink_bias=False, sliding_window_size=8, topk_method="noaux_tc",
                          scoring_func="sigmoid", layernorm_epsilon=1e-5, swa_rope_theta=10000.0,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, swa_v_head_dim=8),
    "minicpm": dict(dim_model_base=32, scale_depth=1.0, scale_emb=1.0),
    "minicpm3": dict(dim_model_base=32, scale_depth=1.0, scale_emb=1.0, rope_scaling={}),
    "minimax": dict(shared_intermediate_size=32, rotary_dim=4),
    "ministral3": dict(rope_parameters=dict(ROPE, llama_4_scaling_beta=0.1, original_max_position_embeddings=512)),
    "mistral4": dict(rope_parameters=dict(ROPE, llama_4_scaling_beta=0.1, original_max_position_embeddings=512)),
    "muse_spark": dict(post_norm_eps=1e-5, rope_parameters=ROPE, layer_rope_theta=[10000.0] * 2, layer_types=SLIDING,
                       sliding_window=8, final_logit_softcapping=None, output_multiplier=1.0, moe_hidden_size=32,
                       mlp_layer_types=["sparse", "sparse"], num_shared_experts=0),
    "nemotron": dict(hidden_act="relu2"),
    "nemotron-nas": dict(block_configs=[{"attention": {"n_heads_in_group": 2, "no_op": False,
                                                       "replace_with_linear": False},
                                         "ffn": {"ffn_mult": 1.5, "no_op": False, "replace_with_linear": False}}] * 2),
    "nemotron_h": dict(MAMBA, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       hybrid_override_pattern=["M", "*"]),
    "olmo3": dict(sliding_window=8, layer_types=SLIDING),
    "olmo_hybrid": dict(LINEAR, linear_allow_neg_eigval=True, layer_types=["linear_attention", "full_attention"]),
    "openelm": dict(num_transformer_layers=2, model_dim=32, ffn_dim_divisor=16, num_query_heads=[4, 4],
                    num_kv_heads=[2, 2], ffn_multipliers=[1.0, 2.0]),
    "phi3small": dict(dense_attention_every_n_layers=2, ff_intermediate_size=64, gegelu_limit=20.0),
    "phixtral": dict(num_vocab=97, model_dim=32, num_heads=4, num_layers=2, rotary_dim=4),
    "plamo": dict(n_shared_head=2),
    "qwen": dict(kv_channels=8),
    "qwen3_5": dict(LINEAR, full_attention_interval=2),
    "qwen3_5_moe": dict(LINEAR, full_attention_interval=2),
    "qwen3_next": dict(LINEAR, full_attention_interval=2),
    "recurrent_gemma": dict(conv1d_width=3, logits_soft_cap=30.0, attention_window_size=8,
                            block_types=["recurrent", "attention"]),
    "rwkv7": dict(a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8),
    "spark2_5": dict(sliding_window=8, layer_types=SLIDING,
                     rope_parameters={"full_attention": ROPE, "sliding_attention": ROPE}),
    "stablelm": dict(use_qkv_bias=False),
    "step3p5": dict(num_attention_groups=2, moe_num_experts=4, moe_top_k=2, share_expert_dim=32, sliding_window=8,
                    layer_types=SLIDING),
}

UNBUILDABLE: dict[str, str] = {
    "olmo": "needs the ai2-olmo package (`hf_olmo`), which is not installed",
    "phi3small": "crashes mlx's CPU backend (segmentation fault) without veloxpatch too",
    "prism_hadamard_qwen35": "loads only packed 2-bit Hadamard-rotated checkpoints, not random weights",
}
METAL_ONLY = frozenset({"bitnet", "muse_spark"})

NOT_MODELS = frozenset({
    "activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline", "rope_utils", "ssm",
    "switch_layers",
})


def model_types() -> list[str]:
    """Every model module in the installed ``mlx_lm.models`` (helpers excluded)."""
    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in NOT_MODELS)


def small_config(model_type: str) -> dict[str, Any]:
    """config.json contents of a tiny ``model_type`` model."""
    flat = {**SMALL, **OVERRIDES.get(model_type, {}), "model_type": model_type}
    return {**flat, "text_config": {**flat, **flat.get("text_config", {})}}


def unbuildable(model_type: str) -> str | None:
    """Why ``model_type`` cannot be built and run here, or None if it can."""
    if model_type in METAL_ONLY and not mx.metal.is_available():
        return "its kernels need the Metal backend"
    return UNBUILDABLE.get(model_type)


def support_table(types: list[str] | None = None) -> str:
    """A markdown table: per model type, what each method does on it (compressed or why not)."""
    methods = sorted(METHODS)
    lines = ["| model type | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for model_type in types or model_types():
        if reason := unbuildable(model_type):
            cells = [f"not built: {reason}"] * len(methods)
        else:  # probed under a temporary patch
            model = build(small_config(model_type))
            cells = [explain_patched(model, VeloxConfig(kv=method)) for method in methods]
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_as_patched(path: Any, config: VeloxConfig) -> Any:
    """The model at ``path`` in the dtype a patched app would run it in (``VELOX_FLOAT32``): its KV rows, and so
    what ``VELOX_KV_MEMORY`` holds, have that dtype. Loaded lazily so that it is cast before it is read, then
    evaluated: the probe never runs a model that is not (``builder.LAZY``)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path, lazy=True)
    if cpu.float32_wanted(config.float32):
        upcast(model)
    mx.eval(model.parameters())
    return model


def explain_patched(model: Any, config: VeloxConfig) -> str:
    """What ``config``'s method does on ``model``, probed under its patch; the patch state is
    restored after (the probe needs the attention route, a report must not leave it on)."""
    previous = active_config()
    patch(config)
    try:
        layer_io.prepare(model, config)
        return builder.explain(model, config)
    finally:
        if previous is None:
            unpatch()
        else:
            patch(previous)


if __name__ == "__main__":
    print(support_table())
