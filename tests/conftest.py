import contextlib
import os

import pytest
import torch

# The "triton" backend's kernels are decorated (interpreted or compiled) when first used: without CUDA, run them
# under Triton's interpreter on CPU tensors (set before relattn is imported, which reads it for what it serves).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile's on-disk caches are keyed by the traced graph, not by what relattn's custom ops are (their names
# carry a hash of their schemas, so a changed op is another op; a changed fake kernel or autograd formula is not).
# The suite keeps its own cache, in this checkout.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".pytest_cache", "torchinductor"))

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")
# Two intra-op threads at most, fewer when pytest-xdist runs a worker per core: the workers share the cores.
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.fixture
def kernel_settings():
    """Sets a backend's kernel settings for the test, through its ``SETTINGS.override`` (undone after it):
    ``kernel_settings(native, gemm16=False)``; later calls stack on earlier ones."""
    with contextlib.ExitStack() as stack:
        yield lambda backend_module, **changes: stack.enter_context(backend_module.SETTINGS.override(**changes))


@pytest.fixture
def small_tiles(kernel_settings):
    """The kernels' tiles made small, so that rows cross several key blocks and tiles end mid-sequence: "native"
    gets 3 queries per tile and 5 keys per block. The fixture's value sets others: ``small_tiles(native=(8, 20),
    native_splits=2, triton=((16, 32), (32, 16)))`` ("triton": forward and backward (queries, keys) tiles)."""
    from relattn.backends import native as native_backend
    from relattn.backends import triton as triton_backend

    def set_tiles(*, native=(3, 5), native_splits=None, triton=None):
        splits = {} if native_splits is None else {"kv_splits": native_splits}
        kernel_settings(native_backend, tile_q=native[0], tile_k=native[1], **splits)
        if triton is not None:
            kernel_settings(triton_backend, fwd_tiles=triton[0], bwd_tiles=triton[1])

    set_tiles()
    return set_tiles


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny tensors (a second thread only waits, and on a loaded machine it
    waits long)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
