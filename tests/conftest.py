"""Property tests are deterministic by default (the same code gives the same examples, so CI
cannot pass or fail by luck); ``HYPOTHESIS_PROFILE=explore`` draws new examples each run (as
many as each test's own ``@settings`` asks for), to look for failures on purpose: a failure
found that way becomes an explicit ``@example`` or a fix."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
