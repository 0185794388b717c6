import os

import torch

# The "triton" backend's kernels are decorated (interpreted or compiled) when first used: without CUDA, run them
# under Triton's interpreter on CPU tensors (set before relattn is imported, which reads it for what it serves).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")
torch.set_num_threads(min(2, os.cpu_count() or 1))
