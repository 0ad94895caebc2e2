"""Data pipeline: embedded stdlib corpus, BPE tokenizer, indexed datasets, GPT datasets.

Submodules are imported on use; ``datasets`` and ``preprocess`` pull in megatron-core.

- :mod:`.corpus`: ``write_stdlib_corpus`` (the Python stdlib's sources as JSON lines).
- :mod:`.tokenizer`: ``train_bpe_tokenizer``, ``HFTokenizer`` (Megatron-facing adapter).
- :mod:`.preprocess`: ``preprocess`` (text/JSON lines -> ``.bin``/``.idx``).
- :mod:`.datasets`: ``build_gpt_datasets``, ``get_batch``.
- :mod:`.default_corpus`: ``ensure_default_data`` (all of the above, built once and cached).
"""
from megatron_lrattn.data.errors import DataError

__all__ = ["DataError"]
