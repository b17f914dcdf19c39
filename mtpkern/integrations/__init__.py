"""Optional bridges from mtpkern to other frameworks' generation loops.

Nothing here is imported by ``import mtpkern``, and importing this package imports no
framework: each bridge imports its framework only when called, and raises ``ImportError``
naming the extra to install when it is missing.

- ``mtpkern.integrations.hf``: a ``MultiModuleMtpHead`` as the drafter of Hugging Face
  transformers' speculative ``generate`` (greedy, batch 1; docs/integrations.md). Needs the
  ``hf`` extra (torch, transformers >= 5.24).
"""
