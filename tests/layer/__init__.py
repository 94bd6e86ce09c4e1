"""Tests of kernelize.layer (a package, so test module names cannot collide with other test folders)."""
