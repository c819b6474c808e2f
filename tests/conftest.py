import os

# The test processes share the machine's cores: under pytest-xdist each worker takes its share
# of threads, and so do the processes it starts (two workers on two cores, each running two
# OpenMP threads, spin against each other: the dense-model and generation tests ran 1.7x slower).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Without a GPU the Triton kernels run in Triton's interpreter; this must be set before
# any kernel module is imported.
if "TRITON_INTERPRET" not in os.environ and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "fxlora",
    deadline=None,
    max_examples=int(os.environ.get("FXLORA_EXAMPLES", "10")),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("fxlora")


def pytest_collection_modifyitems(items):
    """Tests marked ``long`` (half a minute or more on two CPU cores) first, in their order: under
    pytest-xdist the short ones then fill in around them, instead of a long one ending the run
    alone. A test whose name or parameters say ``inductor`` is marked ``inductor``."""
    for item in items:
        if "inductor" in item.name.lower():
            item.add_marker(pytest.mark.inductor)
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# what torchao's quantisation configs set in Inductor's config for the whole process
# (set_inductor_config=True): restored after each test, so none leaks into the next
TORCHAO_INDUCTOR_KEYS = ("coordinate_descent_tuning", "coordinate_descent_check_all_directions",
                         "force_fuse_int_mm_with_mul", "fx_graph_cache", "triton.unique_kernel_names")  # fmt: skip


@pytest.fixture(autouse=True)
def _inductor_config_restored():
    config = torch._inductor.config
    with config.patch({name: config.get_config_copy()[name] for name in TORCHAO_INDUCTOR_KEYS}):
        yield
