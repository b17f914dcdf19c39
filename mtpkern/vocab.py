"""A reduced draft vocabulary (FR-Spec / EAGLE-3's ``d2t`` idea): the LM heads read only the
rows of a token subset, the argmax maps back to target ids, grammar masks stay in target id
space (mtpkern.ops.lm_head's layout).

``DraftVocab(ids, V)``: ``ids`` the subset (unique target ids in ``[0, V)``, sorted here, so
that the lowest subset index is the lowest target id and ties still go to the lowest id);
``sub_mask(rows [n, ceil(V / 32)]) -> [n, ceil(V' / 32)]`` the same allowed tokens, in the
subset's order; ``ids`` is the LM head's ``id_map`` (rows -> target ids, mtpkern.ops.lm_head).
A head over the subset
is ``V' / V`` of the bytes (at GLM-4.5's shapes the LM head is about two thirds of a
module's): ``head_bytes_saved``. A draft's confidence is then the softmax over the subset.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from .argtypes import int_sequence


class DraftVocab:
    """The token subset the draft LM heads read (see the module docstring)."""

    def __init__(self, ids: Any, vocab_size: int, name: str = "draft_vocab"):
        if isinstance(ids, (str, os.PathLike)):
            path = Path(ids)
            ids = read_ids(path, name)
            name = f"{name} (file {os.fspath(path)!r})"          # errors name the file too
        a = int_sequence(name, ids, 0, vocab_size - 1, noun="token id", nouns="token ids",
                         what="a non-empty 1-D array of token ids",
                         out_of_range=lambda i, x: f"{name}: expected token ids in [0, {vocab_size}), got {x} "
                                                   f"(entry {i})")
        if a.size == 0:
            raise ValueError(f"{name}: expected a non-empty 1-D array of token ids, got none")
        s = np.sort(a)
        dup = np.flatnonzero(s[1:] == s[:-1])
        if dup.size:
            raise ValueError(f"{name}: token id {int(s[dup[0]])} appears twice")
        self.ids = s.astype(np.int32)                      # [V'] target id of each subset index
        self.vocab_size = int(vocab_size)
        lo = int(s[0])
        #: the subset is the whole words lo / 32 .. of the target's mask (a vocabulary shard of a
        #: sharded head, mtpkern.shard): ``sub_mask`` slices the words instead of gathering bits
        self._words = (lo // 32, lo // 32 + self.words) if lo % 32 == 0 and int(s[-1]) - lo + 1 == s.size else None

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def words(self) -> int:
        """Words of a bitmask row over the subset."""
        return (self.size + 31) // 32

    def sub_mask(self, rows: np.ndarray) -> np.ndarray:
        """[n, ceil(V / 32)] int32 target-space masks -> [n, ceil(V' / 32)] over the subset (the
        bits past V' of the last word may be set: they are padding, never read as tokens)."""
        if self._words is not None:
            return np.ascontiguousarray(np.asarray(rows, np.int32)[:, self._words[0]:self._words[1]])
        words = np.asarray(rows).astype(np.int64) & 0xFFFFFFFF
        bits = (words[:, self.ids >> 5] >> (self.ids & 31)) & 1             # [n, V']
        pad = np.zeros((bits.shape[0], self.words * 32), np.int64)
        pad[:, :self.size] = bits
        packed = (pad.reshape(bits.shape[0], self.words, 32) << np.arange(32)).sum(axis=2)
        return packed.astype(np.uint32).view(np.int32)

    def head_bytes_saved(self, hidden_size: int, itemsize: int = 2) -> int:
        """Bytes one LM head no longer reads per row of drafts."""
        return (self.vocab_size - self.size) * hidden_size * itemsize


def read_ids(path: Path, name: str) -> Any:
    """Token ids from a ``.npy`` file (an integer array, read without pickles) or a text file of
    whitespace-separated decimal integers; a file that cannot be read as such raises
    ``ValueError`` naming ``name`` and the file. The ids are not range-checked here: the
    text form gives Python ints (a huge one keeps its value), ``DraftVocab`` checks them."""
    where = f"{name}: {os.fspath(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{where} is not a file")
    if path.suffix == ".npy":
        try:
            a = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError, TypeError, SyntaxError) as e:
            raise ValueError(f"{where}: expected a .npy file of integer token ids, could not read it "
                             f"({type(e).__name__}: {e})") from None
        if not isinstance(a, np.ndarray):
            raise ValueError(f"{where}: expected a .npy file of integer token ids, got {type(a).__name__}")
        return a
    try:
        text = path.read_text(encoding="ascii")
    except (UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{where}: expected an ASCII text file of whitespace-separated token ids ({e})") from None
    out = []
    for j, t in enumerate(text.split()):
        if not _DECIMAL.fullmatch(t):
            raise ValueError(f"{where}: expected whitespace-separated decimal token ids, got {t[:40]!r} "
                             f"(entry {j})")
        out.append(int(t))
    return out


_DECIMAL = re.compile(r"[+-]?[0-9]+")
