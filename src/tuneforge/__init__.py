"""tuneforge: fine-tune Hugging Face causal language models, dense and MoE."""

__version__ = "0.1.0"

import logging as _logging

# bitsandbytes announces on import, on every CPU with AVX512-BF16, that an optional kernel from the hub is not
# installed; it falls back to its own kernels, and fetching from the hub is not something a run should do.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
