"""Settings shared by every test module: the hypothesis profiles.

``ci`` (the default) keeps property tests to seconds: few examples, derandomized (the same
examples every run, so a failure reproduces), no deadline (the 2-core CI machine is shared)
and no example database written. ``HYPOTHESIS_PROFILE=dev`` searches wider, for local runs.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
