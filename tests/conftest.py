import os

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


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
