"""The built-in synthetic checkpoints of the benchmarks.

Random weights in the layout of a real checkpoint (``weights.write_synthetic_checkpoint``),
written once per (name, seed) under the user's cache directory and reused after.
The drafts they give are random tokens: they exercise the code, not a model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .config import MtpConfig, small_config, tiny_config

#: name -> config of each built-in checkpoint (M=3 modules each)
CONFIGS: dict[str, Callable[[], MtpConfig]] = {
    # H=64, 4 q / 2 kv heads, D=16, E=8 top-2, V=301: the tests' shapes
    "tiny": tiny_config,
    # H=256, 8 q / 2 kv heads, D=32, E=16 top-4, I=128, V=8192: the demo's default
    "demo": lambda: tiny_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                vocab_size=8192, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                topk_group=2, moe_intermediate_size=128),
    # H=1024, 16 q / 4 kv heads, D=64, E=32 top-4, 4 groups / 2 kept, I=512, 1 shared, V=32768;
    # positions to 65536, so that the bench's --contexts reach 32768
    "small": lambda: small_config(max_position_embeddings=65536),
    # a GLM-4.5-Air-sized module (H=4096, 96 q / 8 kv heads, D=128, E=128 top-8, V=151552)
    "glm45air": lambda: small_config(hidden_size=4096, num_attention_heads=96, num_key_value_heads=8,
                                     head_dim=128, n_routed_experts=128, num_experts_per_tok=8, n_group=1,
                                     topk_group=1, moe_intermediate_size=1408, vocab_size=151552),
    # Step-3.5-Flash's MTP module at a quarter of its width: sliding-window attention (window
    # 512) with 24 query heads of 128 over 2 KV heads (its group of 12), a head-wise output
    # gate, whole-head RoPE (theta 1e4), a dense SwiGLU MLP (I=2816), V=32768
    "step35": lambda: tiny_config(hidden_size=1024, num_attention_heads=24, num_key_value_heads=2, head_dim=128,
                                  vocab_size=32768, n_routed_experts=0, num_experts_per_tok=0, n_shared_experts=0,
                                  n_group=1, topk_group=1, intermediate_size=2816, partial_rotary_factor=1.0,
                                  rope_theta=1e4, sliding_window=512, attn_gate="headwise", attention_bias=False,
                                  max_position_embeddings=65536),
    # DeepSeek-V3's MTP block at a seventh of its width: MLA with its own latent sizes (L 512,
    # R 64, P 128, Dv 128, q_lora 384) over 16 heads, interleaved RoPE, YaRN (x40 of 4096),
    # E=32 top-4 of 4 groups / 2 kept, I=512, 1 shared, V=32768, the postnorm chain
    "mla": lambda: small_config(num_attention_heads=16, num_key_value_heads=16, head_dim=192, kv_lora_rank=512,
                                q_lora_rank=384, qk_rope_head_dim=64, v_head_dim=128, partial_rotary_factor=1.0,
                                attention_bias=False, use_qk_norm=False, rope_interleave=True, rope_theta=1e4,
                                rope_scaling={"factor": 40.0, "original_max_position_embeddings": 4096,
                                              "mscale": 1.0, "mscale_all_dim": 1.0},
                                max_position_embeddings=163840, family="deepseek_v3"),
    # the mla block with DeepSeek-V3.2's DSA indexer (64 heads of 128, 2048 keys picked)
    "dsa": lambda: dataclasses.replace(CONFIGS["mla"](), family="deepseek_v32", index_topk=2048, index_n_heads=64,
                                       index_head_dim=128),
    # DeepSeek-V4-Flash's MTP block at a quarter of its width: 4 streams of H=1024 (hyper-
    # connections, 20 Sinkhorn iterations), 16 query heads of 512 over one shared K = V head
    # (64 rotary dims last, in pairs), q latent 256, 2 output groups of rank 256, sinks, a window
    # of 128; E=64 top-6 sqrtsoftplus (no groups), I=512, 1 shared, clamps of 10 of the gate;
    # FP8 projections (E8M0 block-128 scales), FP4 routed experts, V=32768, M=1 (as released)
    "dsv4": lambda: small_config(family="deepseek_v4", num_nextn_predict_layers=1, num_attention_heads=16,
                                 num_key_value_heads=1, head_dim=512, partial_rotary_factor=0.125,
                                 rope_interleave=True, rope_theta=1e4, q_lora_rank=256, shared_kv=True,
                                 out_rope=True, o_groups=2, o_lora_rank=256, attn_sinks=True, sliding_window=128,
                                 attention_bias=False, hc_mult=4, n_routed_experts=64, num_experts_per_tok=6,
                                 n_group=1, topk_group=1, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
                                 swiglu_clamp=10.0, swiglu_clamp_shared=10.0, swiglu_clamp_gate=True,
                                 rms_norm_eps=1e-6, weight_quant="fp8", fp8_block=(128, 128), expert_quant="fp4",
                                 max_position_embeddings=65536),
}


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mtpkern``, else ``~/.cache/mtpkern``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mtpkern"


def synthetic_checkpoint(name: str, seed: int = 0, say: Callable[[str], None] | None = None) -> Path:
    """The directory of the built-in synthetic checkpoint ``name`` (a key of ``CONFIGS``),
    written on first use; ``say`` gets one line when it has to be written.

    The files are written into a temporary directory beside the final one and renamed
    into place, so a run killed half-way, or two runs at once, never leave a partial one.
    The directory's name ends in a digest of the config, so a checkpoint written for an
    earlier definition of ``name`` is never read as this one.
    """
    from .weights import write_synthetic_checkpoint

    if name not in CONFIGS:
        raise ValueError(f"name: expected one of {sorted(CONFIGS)}, got {name!r}")
    config = CONFIGS[name]()
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode()).hexdigest()
    path = cache_dir() / f"synthetic-{name}-{seed}-{digest[:12]}"
    if (path / "config.json").exists():
        return path
    if say is not None:
        say(f"writing the synthetic {name!r} checkpoint to {path} (once)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        write_synthetic_checkpoint(tmp, config, seed=seed)
        os.replace(tmp, path)
    except OSError:
        if not (path / "config.json").exists():   # not another process winning the race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
