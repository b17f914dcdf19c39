"""The released MTP families mtpkern loads: one file each (``base.Family``).

``family_of(config_dict)`` finds a config's family by ``model_type`` or
``architectures``; a config naming neither is read in the canonical layout
(``CANONICAL``, the canonical tensor table of docs/model.md: hand-written and synthetic checkpoints). A config
whose model_type or architecture is a family's wrapper (``Family.wrappers``: a
vision-language model around the family's text model) is read as its ``text_config``.
"""

from __future__ import annotations

from .base import Family
from .deepseek_v3 import FAMILY as DEEPSEEK_V3
from .deepseek_v32 import FAMILY as DEEPSEEK_V32
from .deepseek_v4 import FAMILY as DEEPSEEK_V4
from .glm4_moe import FAMILY as GLM4_MOE
from .glm4_moe_lite import FAMILY as GLM4_MOE_LITE
from .glm5_next import FAMILY as GLM5_NEXT
from .glm_moe_dsa import FAMILY as GLM_MOE_DSA
from .kimi_k3 import FAMILY as KIMI_K3
from .longcat_flash import FAMILY as LONGCAT_FLASH
from .mimo import FAMILY as MIMO
from .mimo_v2_flash import FAMILY as MIMO_V2_FLASH
from .nemotron_h import FAMILY as NEMOTRON_H, PUZZLE as NEMOTRON_H_PUZZLE
from .qwen3_5 import DENSE as QWEN3_5, MOE as QWEN3_5_MOE
from .qwen3_next import FAMILY as QWEN3_NEXT
from .step3p5 import FAMILY as STEP3P5

#: model_type -> family
FAMILIES: dict[str, Family] = {f.model_type: f for f in (GLM4_MOE, MIMO, MIMO_V2_FLASH, QWEN3_NEXT, STEP3P5,
                                                         DEEPSEEK_V3, DEEPSEEK_V32, GLM_MOE_DSA, GLM4_MOE_LITE,
                                                         LONGCAT_FLASH, DEEPSEEK_V4, GLM5_NEXT, QWEN3_5,
                                                         QWEN3_5_MOE, NEMOTRON_H, NEMOTRON_H_PUZZLE, KIMI_K3)}

#: the canonical layout (docs/model.md) with MtpConfig's defaults (no model_type, no architectures)
CANONICAL = Family(model_type="", architectures=(), title="canonical layout (no model_type)")


def by_architecture() -> dict[str, Family]:
    return {a: f for f in FAMILIES.values() for a in f.architectures}


def by_wrapper() -> dict[str, Family]:
    """Outer model_type and outer architecture -> the family its ``text_config`` holds."""
    out: dict[str, Family] = {}
    for f in FAMILIES.values():
        for outer, archs in f.wrappers.items():
            out[outer] = f
            out.update({a: f for a in archs})
    return out


def supported() -> str:
    """The supported families, for messages: ``glm4_moe (Glm4MoeForCausalLM), ...``."""
    return ", ".join(f"{t} ({' / '.join(f.architectures)})" for t, f in FAMILIES.items())


def family(name: str) -> Family:
    """The family of ``model_type`` ``name`` ("" = the canonical layout)."""
    if name == "":
        return CANONICAL
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)} or '', got {name!r}") from None


__all__ = ["CANONICAL", "FAMILIES", "Family", "by_architecture", "by_wrapper", "family", "supported"]
