"""Model configuration of an MTP checkpoint, parsed from ``config.json``.

Field names follow Hugging Face ``Glm4MoeConfig`` / ``DeepseekV3Config``.
Letters used throughout the project: ``H`` hidden, ``Hq`` / ``Hkv`` query and
key-value heads, ``D`` head dim, ``V`` vocab, ``E`` routed experts, ``K``
experts per token, ``I`` expert intermediate size, ``M`` modules.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .errors import ConfigError
from .files import CONFIG_JSON_CAP, read_json

ScoringFunc = Literal["sigmoid", "softmax"]


def _req(d: dict, name: str, typ: type | tuple[type, ...]) -> Any:
    if name not in d or d[name] is None:
        raise ConfigError(f"config.json: required field {name!r} is missing")
    return _typed(name, d[name], typ)


def _opt(d: dict, name: str, typ: type | tuple[type, ...], default: Any) -> Any:
    if name not in d or d[name] is None:
        return default
    return _typed(name, d[name], typ)


def _typed(name: str, value: Any, typ: type | tuple[type, ...]) -> Any:
    # bool is an int subclass: refuse True where a count is expected.
    if isinstance(value, bool) and typ is not bool:
        raise ConfigError(f"config.json: field {name!r} expected {_tname(typ)}, got bool {value!r}")
    if typ is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, typ):
        raise ConfigError(
            f"config.json: field {name!r} expected {_tname(typ)}, got {type(value).__name__} {value!r}"
        )
    return value


def _tname(typ: type | tuple[type, ...]) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


@dataclass(frozen=True, slots=True)
class MtpConfig:
    """Everything the drafter needs to know about the checkpoint's shapes.

    ``is_moe`` tells whether the MTP modules use routed experts (else a dense
    SwiGLU MLP of ``intermediate_size``).
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    use_qk_norm: bool = False
    intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: ScoringFunc = "sigmoid"
    first_k_dense_replace: int = 0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        def pos(name: str) -> None:
            v = getattr(self, name)
            if v <= 0:
                raise ConfigError(f"config.json: field {name!r} must be > 0, got {v}")

        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "vocab_size", "num_nextn_predict_layers", "max_position_embeddings"):
            pos(name)
        if self.num_hidden_layers < 0:
            raise ConfigError(f"config.json: field 'num_hidden_layers' must be >= 0, got {self.num_hidden_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads, got "
                f"{self.num_attention_heads} and {self.num_key_value_heads}"
            )
        if not (0.0 < self.partial_rotary_factor <= 1.0):
            raise ConfigError(
                f"config.json: partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )
        rd = self.rotary_dim
        if rd < 2 or rd % 2:
            raise ConfigError(
                f"config.json: head_dim * partial_rotary_factor must be an even number >= 2, "
                f"got {self.head_dim} * {self.partial_rotary_factor} = {rd}"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError(
                f"config.json: rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps} and {self.rope_theta}"
            )
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ConfigError(
                f"config.json: field 'scoring_func' expected 'sigmoid' or 'softmax', got {self.scoring_func!r}"
            )
        if self.is_moe:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
                pos(name)
            E, G = self.n_routed_experts, self.n_group
            if E % G:
                raise ConfigError(f"config.json: n_routed_experts ({E}) must be a multiple of n_group ({G})")
            if self.topk_group > G:
                raise ConfigError(f"config.json: topk_group ({self.topk_group}) must be <= n_group ({G})")
            if self.num_experts_per_tok > self.topk_group * (E // G):
                raise ConfigError(
                    f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                    f"topk_group groups ({self.topk_group} * {E // G})"
                )
            if self.n_shared_experts < 0:
                raise ConfigError(f"config.json: n_shared_experts must be >= 0, got {self.n_shared_experts}")
        elif self.intermediate_size <= 0:
            raise ConfigError(
                "config.json: a dense MTP module needs intermediate_size > 0 "
                f"(got {self.intermediate_size}); set n_routed_experts for an MoE module"
            )

    # -- derived shapes ---------------------------------------------------
    @property
    def num_modules(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        """MoE iff routed experts are configured. MTP layers always lie past the target's
        dense prefix (``first_k_dense_replace``); Hugging Face builds every MTP layer as
        MoE whatever that prefix is, and so do we."""
        return self.n_routed_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def bitmask_words(self) -> int:
        """Width W of an xgrammar bitmask for this vocabulary: ceil(V / 32) int32 words."""
        return (self.vocab_size + 31) // 32

    def layer_index(self, module: int) -> int:
        """Index of module ``module`` under ``model.layers.``."""
        return self.num_hidden_layers + module

    # -- (de)serialisation ------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "MtpConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config.json: expected a JSON object, got {type(d).__name__}")
        H = _req(d, "hidden_size", int)
        Hq = _req(d, "num_attention_heads", int)
        hd = _opt(d, "head_dim", int, None)
        if hd is None:
            if H % Hq:
                raise ConfigError(
                    f"config.json: head_dim is missing and hidden_size ({H}) is not a multiple of "
                    f"num_attention_heads ({Hq})"
                )
            hd = H // Hq
        rope = d.get("rope_parameters")
        if rope is None:
            rope = d.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config.json: field 'rope_parameters' expected an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(
                f"config.json: rope_parameters.rope_type {rope_type!r} is not supported; expected 'default'"
            )
        theta = _opt(rope, "rope_theta", float, None)
        if theta is None:
            theta = _opt(d, "rope_theta", float, 10000.0)
        prf = _opt(rope, "partial_rotary_factor", float, None)
        if prf is None:
            # Glm4MoeConfig's default is 0.5; DeepseekV3-style configs rotate whole heads.
            prf = _opt(d, "partial_rotary_factor", float, 0.5 if d.get("model_type") == "glm4_moe" else 1.0)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act expected 'silu', got {act!r}")
        return cls(
            hidden_size=H,
            num_attention_heads=Hq,
            num_key_value_heads=_opt(d, "num_key_value_heads", int, Hq),
            head_dim=hd,
            vocab_size=_req(d, "vocab_size", int),
            num_hidden_layers=_req(d, "num_hidden_layers", int),
            num_nextn_predict_layers=_req(d, "num_nextn_predict_layers", int),
            rms_norm_eps=_opt(d, "rms_norm_eps", float, 1e-5),
            rope_theta=theta,
            partial_rotary_factor=prf,
            attention_bias=_opt(d, "attention_bias", bool, False),
            use_qk_norm=_opt(d, "use_qk_norm", bool, False),
            intermediate_size=_opt(d, "intermediate_size", int, 0),
            n_routed_experts=_opt(d, "n_routed_experts", int, 0),
            num_experts_per_tok=_opt(d, "num_experts_per_tok", int, 0),
            n_shared_experts=_opt(d, "n_shared_experts", int, 0),
            moe_intermediate_size=_opt(d, "moe_intermediate_size", int, 0),
            n_group=_opt(d, "n_group", int, 1),
            topk_group=_opt(d, "topk_group", int, 1),
            routed_scaling_factor=_opt(d, "routed_scaling_factor", float, 1.0),
            norm_topk_prob=_opt(d, "norm_topk_prob", bool, True),
            scoring_func=_opt(d, "scoring_func", str, "sigmoid"),
            first_k_dense_replace=_opt(d, "first_k_dense_replace", int, 0),
            tie_word_embeddings=_opt(d, "tie_word_embeddings", bool, False),
            max_position_embeddings=_opt(d, "max_position_embeddings", int, 4096),
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "MtpConfig":
        """Read ``path``: a regular file (or a symlink to one) of at most ``CONFIG_JSON_CAP``
        bytes of UTF-8 JSON."""
        return cls.from_dict(read_json(path, CONFIG_JSON_CAP, ConfigError))

    def to_dict(self) -> dict:
        """A config.json body (Hugging Face names) that ``from_dict`` reads back."""
        d = asdict(self)
        theta = d.pop("rope_theta")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        d["hidden_act"] = "silu"
        return d

    def describe(self) -> str:
        kind = (f"MoE E={self.n_routed_experts} top-{self.num_experts_per_tok} "
                f"groups {self.topk_group}/{self.n_group} I={self.moe_intermediate_size} "
                f"shared={self.n_shared_experts}") if self.is_moe else f"dense I={self.intermediate_size}"
        return (f"M={self.num_modules} H={self.hidden_size} Hq={self.num_attention_heads} "
                f"Hkv={self.num_key_value_heads} D={self.head_dim} rotary={self.rotary_dim} "
                f"V={self.vocab_size} {kind}")


def tiny_config(**overrides: Any) -> MtpConfig:
    """A small MoE config used by tests and the CI smoke benchmark."""
    base = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=301, num_hidden_layers=2, num_nextn_predict_layers=3,
        rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=32, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
    )
    base.update(overrides)
    return MtpConfig(**base)


def small_config(**overrides: Any) -> MtpConfig:
    """The ``small`` benchmark shape set (``SHAPES`` in mtpkern/bench.py)."""
    base = dict(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        vocab_size=32768, num_hidden_layers=2, num_nextn_predict_layers=3,
        rms_norm_eps=1e-5, rope_theta=1e6, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=True, n_routed_experts=32, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=512, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=8192,
    )
    base.update(overrides)
    return MtpConfig(**base)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
