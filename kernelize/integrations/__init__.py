"""Integrations with model libraries: `kernelize.integrations.transformers.kernelize_model`."""
