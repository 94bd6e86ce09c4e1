"""Test kernel repository `broken`: importing it fails, as a build with a missing dependency would."""

import kernelize_test_missing_dependency  # noqa: F401
