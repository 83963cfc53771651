"""Run by the fork server (test_testing_preload.py gives it to ``preload_in_workers``): leaves a
mark every forked worker inherits."""

import wave

wave.HP_TESTING_PRELOADED = True  # type: ignore[attr-defined]
