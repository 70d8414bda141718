"""What every unit test shares: hypothesis runs without its timing checks.

Tests assert no timings (the house rule): on a loaded 2-core machine one example can take
seconds, and hypothesis' default 200 ms deadline and its too-slow health check then fail a
correct test (CI saw one: ``test_any_names_give_a_valid_spec_file_or_a_clear_refusal``, 1.1 s).
"""

from hypothesis import HealthCheck, settings

settings.register_profile("no-timing", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("no-timing")
