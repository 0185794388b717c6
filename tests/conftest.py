import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")
torch.set_num_threads(min(2, os.cpu_count() or 1))
