"""Session-wide test setup that must happen before any module imports triton."""

import os
import shutil

# Without a GPU, the Triton decode kernels (tests/unit/test_triton_decode.py) run under Triton's
# interpreter. Triton reads TRITON_INTERPRET when its own standard library (tl.sum, ...) is defined, at
# its first import, which transformers or torch may trigger long before that test module: so set it here.
# nvidia-smi absent is the cheap "no GPU" check (importing torch here to ask would be early too).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
