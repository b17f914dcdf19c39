"""Write ``byte_counts.json`` beside a trained byte-level checkpoint: how often each byte value
occurs in its training data (never in the held-out files), for draft vocabularies of the most
frequent bytes (``mtpkern acceptance``'s draft-vocabulary rows).

    python scripts/byte_counts.py mtpkern/checkpoints/stdlib-glm-tiny

The training data are re-read from this Python's standard library as ``training.json`` lists
them (``train_files``, joined by b'\\n'); the script refuses when their length or SHA-256
(of the files concatenated, as scripts/train_tiny.py computes it) differs from the record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="checkpoint directory holding training.json")
    args = ap.parse_args(argv)
    ckpt = Path(args.ckpt)
    rec = json.loads((ckpt / "training.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    blobs = [(root / f).read_bytes() for f in rec["train_files"]]
    sha = hashlib.sha256(b"".join(blobs)).hexdigest()
    data = b"\n".join(blobs)
    if sha != rec["train_sha256"] or len(data) != rec["train_bytes"]:
        raise SystemExit(f"{root}: expected the training data of training.json ({rec['train_bytes']} bytes, "
                         f"sha256 {rec['train_sha256']}), got {len(data)} bytes, sha256 {sha}")
    held = set(rec["held_out_files"])
    if held & set(rec["train_files"]):
        both = sorted(held & set(rec["train_files"]))
        raise SystemExit(f"training.json: expected no held-out file among the training files, got {both}")
    counts = np.bincount(np.frombuffer(data, np.uint8), minlength=256)
    out = {"data": "the training files of training.json (train_files, joined by b'\\n'); no held-out file",
           "train_bytes": len(data), "train_sha256": sha, "counts": [int(c) for c in counts]}
    (ckpt / "byte_counts.json").write_text(json.dumps(out) + "\n")
    print(f"wrote {ckpt / 'byte_counts.json'}: {int((counts > 0).sum())} byte values seen in {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
