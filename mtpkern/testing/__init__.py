"""A testing kit for engines that drive mtpkern (docs/testing.md).

Property-test an integration, not only the library: the pieces mtpkern's own
tests use.

- ``checked(prop, weights=None)``: the proposer with every call checked against a
  model of what it must hold (``ProposerModel``): invariants, rows per module,
  "a failed call changes nothing", and with ``weights`` the exact-mode drafts
  against the dense oracle; with ``target=`` (a ``ReferenceTarget``) every hidden and token
  the engine hands in against the target's own (``truth``). Give it to your scheduler in place
  of the proposer.
- ``oracle``: the from-scratch float64 recomputation of the module chain.
- ``reference_weights(ckpt_dir)``: host FP32 weights for the oracle.
- ``Call`` / ``Driver``: random call sequences as data, and their runner.
- ``strategies.calls`` / ``strategies.call_sequences``: hypothesis strategies.
- ``machine.proposer_machine(make_proposer)``: the rule-based state machine.

``strategies`` and ``machine`` need ``hypothesis`` (``pip install 'mtpkern[testing]'``, from a source
checkout ``pip install -e '.[testing]'``);
the rest needs nothing beyond mtpkern.
"""

from __future__ import annotations

import os
from typing import Any

from . import oracle
from .checked import CheckedProposer, checked
from .driver import KINDS, Call, Driver
from .model import ProposerModel, SeqModel
from .truth import TargetTruth

__all__ = ["KINDS", "Call", "CheckedProposer", "Driver", "ProposerModel", "SeqModel", "TargetTruth", "checked",
           "oracle", "reference_weights"]


def reference_weights(ckpt_dir: str | os.PathLike, apply_target_norm: bool = False) -> Any:
    """The checkpoint's weights as host FP32 arrays (the NumPy backend's form), for the
    oracle; with ``apply_target_norm`` as the proposer under test was built."""
    from ..backends import get_backend
    from ..config import MtpConfig
    from ..weights import load_weights

    cfg = MtpConfig.from_json(os.path.join(os.fspath(ckpt_dir), "config.json"))
    return load_weights(ckpt_dir, cfg, get_backend("numpy"), apply_target_norm=apply_target_norm)
