"""mtpkern: multi-module MTP draft proposer for speculative decoding.

    from mtpkern import MultiModuleMtpHead
    prop = MultiModuleMtpHead.from_pretrained(ckpt_dir, backend="auto", kv_mode="exact")
    st = prop.alloc_state()
    prop.prefill_drafter(prompt_tokens, hiddens, st)
    drafts = prop.propose(last_token, target_hidden, position, num_drafts, st)
    prop.after_verify(num_accepted, st)
    prop.catchup_drafter(accepted_tokens, accepted_hiddens, st)
    prop.free_state(st)

The contract is docs/api.md and docs/semantics.md. Nothing is compiled or
allocated on import.
"""

from .config import MtpConfig
from .errors import CheckpointError, ConfigError, KvCacheFull, MtpError, NoAllowedToken, StateError
from .ops.sampling import SamplingParams
from .head import HeadStep, MtpHead
from .k_policy import KChoice, StepCosts, acceptance_from_counts, acceptance_from_stats, choose_k
from .loop import Decisions, Generation, greedy_generate, speculative_generate
from .proposer import MemoryUse, MultiModuleMtpHead
from .quant import Fp8Weight
from .state import AcceptanceStats, DrafterKv, MtpState
from .target import ReferenceTarget
from .trait import DraftProposer, ProposerState
from .weights import load_weights, write_synthetic_checkpoint

__version__ = "0.1.0"

__all__ = [
    "AcceptanceStats", "CheckpointError", "ConfigError", "Decisions", "DraftProposer", "DrafterKv", "Fp8Weight",
    "Generation", "HeadStep", "KChoice", "KvCacheFull", "MemoryUse", "MtpConfig", "MtpError", "MtpHead",
    "MtpState", "MultiModuleMtpHead", "NoAllowedToken", "ProposerState", "ReferenceTarget", "SamplingParams",
    "StateError", "StepCosts", "acceptance_from_counts", "acceptance_from_stats", "choose_k", "greedy_generate",
    "load_weights", "speculative_generate", "write_synthetic_checkpoint",
]
