import os

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
