"""More drafts than modules: a module schedule (``module_schedule=`` on the proposer).

Draft step ``s`` of a propose runs module ``schedule[s]``'s weights. Most released
checkpoints have one MTP module (DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo-7B); a schedule is
how they draft more than one token per propose:

- ``None`` / ``"clamp"``: ``[0 .. M-1]``, today's behaviour (``num_drafts > M`` is clamped to
  ``M`` and counted in ``clamped_calls``);
- ``"last"``: ``[0 .. M-1, M-1, ..]`` to ``max_drafts`` steps (module reuse, as vLLM and
  TensorRT-LLM's MTP-Eagle reuse the last module);
- ``"cycle"``: ``[s mod M]`` to ``max_drafts`` steps;
- a list of module indices, one per step.

Each step is a module of its own to the proposer: it has the weights of its scheduled
module (shared, held once) and **its own KV pool**, because its inputs differ from that
module's: step ``s`` reads step ``s-1``'s outputs, and its rows are those of a module at
index ``s`` (key ``j`` at RoPE position ``j + s + 1``, token ``t_{j+s+1}``). So every rule of
the two KV modes holds with ``M`` = the number of steps (docs/semantics.md, "Module
schedules"): draft mode keeps step ``s``'s row of a propose iff ``s <= a``; exact mode keeps
every step's rows equal to the from-scratch chain of the steps (the dense oracle over the
expanded config, ``expand``). The cost: one KV pool per step, not per distinct module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .argtypes import int_sequence, kind, scalar_int
from .config import MtpConfig


def resolve(spec: Any, M: int, max_drafts: Any) -> list[int]:
    """The schedule ``spec`` (module docstring) for ``M`` modules -> one module index per step.

    ``max_drafts`` and the entries of a list schedule follow the integer rule of every
    public call (mtpkern.argtypes: Python or NumPy integers, never a bool or a float); a
    list schedule may be a list, tuple or 1-D integer array."""
    if spec is None or (isinstance(spec, str) and spec == "clamp"):
        if max_drafts is not None:
            raise ValueError(f"max_drafts: the clamp schedule drafts at most M = {M}; got max_drafts = "
                             f"{max_drafts!r} (pass module_schedule='last' or 'cycle' to draft more)")
        return list(range(M))
    if isinstance(spec, str):
        if spec not in ("last", "cycle"):
            raise ValueError(f"module_schedule: expected None, 'clamp', 'last', 'cycle' or a list of module "
                             f"indices, got {spec!r}")
        if max_drafts is None:
            raise ValueError(f"max_drafts: expected an int in [1, 64] with module_schedule={spec!r}, got None")
        n = scalar_int(max_drafts)
        if n is None:
            raise TypeError(f"max_drafts: expected an int in [1, 64] with module_schedule={spec!r}, got "
                            f"{kind(max_drafts)} {max_drafts!r}")
        if not 1 <= n <= 64:
            raise ValueError(f"max_drafts: expected an int in [1, 64] with module_schedule={spec!r}, got {n}")
        if spec == "last":
            return [min(s, M - 1) for s in range(n)]
        return [s % M for s in range(n)]
    if max_drafts is not None:
        raise ValueError("max_drafts: a list schedule has as many steps as entries; pass one or the other")
    what = "a list of 1 .. 64 module indices"
    steps = int_sequence("module_schedule", spec, 0, M - 1, noun="module index", nouns="module indices", what=what,
                         out_of_range=lambda s, m: f"module_schedule[{s}]: expected a module index in [0, {M}), "
                                                   f"got {m}")
    if not 1 <= steps.size <= 64:
        raise ValueError(f"module_schedule: expected {what}, got {steps.size} entries")
    return [int(m) for m in steps]


def expand(config: MtpConfig, weights: Any, schedule: list[int]) -> tuple[MtpConfig, Any]:
    """(config, weights) with one module per step: step ``s`` is module ``schedule[s]``'s
    block and weights (the same arrays)."""
    if schedule == list(range(config.num_modules)):
        return config, weights
    blocks = tuple(config.blocks[m] for m in schedule) if config.blocks else ()
    cfg = dataclasses.replace(config, num_nextn_predict_layers=len(schedule), blocks=blocks)
    w = dataclasses.replace(weights, config=cfg, modules=[weights.modules[m] for m in schedule])
    return cfg, w
