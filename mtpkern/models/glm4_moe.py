"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (``glm4_moe``): the canonical layout itself.

Modules at ``model.layers.{num_hidden_layers + m}.`` with the canonical table's names (docs/model.md);
``Glm4MoeConfig`` rotates half of each head by default (``partial_rotary_factor``
0.5). The embedding and LM head fall back to the target's.
"""

from .base import Family

FAMILY = Family(
    model_type="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    title="GLM-4.5 / 4.5-Air / 4.6 / 4.7",
    defaults={"partial_rotary_factor": 0.5},
)
