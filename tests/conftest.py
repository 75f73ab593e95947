import os

from hypothesis import settings

# CI runs the full 10,000 generated cases per parser; `make check` a quick sample.
settings.register_profile("ci", max_examples=10_000, deadline=None)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
